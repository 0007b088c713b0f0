"""A worker's pace for the estimates: smoothed over engine steps, not over heartbeats."""

from __future__ import annotations

import math

import pytest

from workers.engine.outputs import EngineStats
from workers.inference.service_rate import DRY_SPELL_S, SMOOTHING_STEPS, ServiceRate, WorkLeft


class Totals:
    """Engine totals that the test advances as steps would."""

    def __init__(self) -> None:
        self.stats = EngineStats(num_running=0, num_waiting=0, num_kv_blocks_used=0,
                                 num_kv_blocks_free=0, num_prefix_cache_hit_tokens=0,
                                 num_preemptions=0, num_computed_tokens=0,
                                 num_generated_tokens=0, busy_seconds=0.0, num_steps=0)

    def run(self, *, num_steps: int, tokens: int, seconds: float) -> None:
        self.stats.num_steps += num_steps
        self.stats.num_computed_tokens += tokens
        self.stats.busy_seconds += seconds

    def __call__(self) -> EngineStats:
        return EngineStats(**{f: getattr(self.stats, f) for f in EngineStats.__slots__})


def test_a_beat_of_one_slow_step_moves_the_pace_little() -> None:
    """A 3 s decode step of 256 tokens after a long measured pace of 1,000 tokens/s moves
    it by 1/64th of the way (1 - e^(-1/64)), not by a fixed share of it."""
    totals = Totals()
    rate = ServiceRate(totals)
    rate.sample()
    totals.run(num_steps=500, tokens=5000, seconds=5.0)
    assert rate.sample().tokens_per_s == pytest.approx(1000.0)
    totals.run(num_steps=1, tokens=256, seconds=3.0)
    weight = 1 - math.exp(-1 / SMOOTHING_STEPS)
    pace = rate.sample()
    assert pace.tokens_per_s == pytest.approx(1000 * (1 - weight) + 256 / 3 * weight)
    assert pace.tokens_per_s is not None and pace.tokens_per_s > 980


def test_a_beat_of_many_steps_sets_the_pace() -> None:
    """Hundreds of steps in one beat: the pace follows them almost whole."""
    totals = Totals()
    rate = ServiceRate(totals)
    rate.sample()
    totals.run(num_steps=100, tokens=1000, seconds=1.0)
    rate.sample()
    totals.run(num_steps=640, tokens=12_800, seconds=6.4)
    pace = rate.sample()
    assert pace.tokens_per_s == pytest.approx(2000.0, rel=1e-3)
    assert pace.step_s == pytest.approx(0.01, rel=1e-3)


def test_too_little_busy_time_waits_for_more() -> None:
    totals = Totals()
    rate = ServiceRate(totals)
    rate.sample()
    totals.run(num_steps=2, tokens=100, seconds=0.05)
    assert rate.sample().tokens_per_s is None
    totals.run(num_steps=20, tokens=900, seconds=0.45)
    assert rate.sample().tokens_per_s == pytest.approx(2000.0)


def test_every_sample_carries_the_work_left_as_it_is_now() -> None:
    """The work left is a level, not a rate: each sample carries the engine's latest
    figures, even one too soon after the last to move the pace."""
    totals = Totals()
    rate = ServiceRate(totals)
    totals.stats.num_requests_left, totals.stats.num_tokens_to_compute = 4, 400
    totals.stats.num_output_tokens_left = 100
    assert rate.sample().work_left == WorkLeft(4, 400, 100)
    totals.run(num_steps=1, tokens=4, seconds=0.01)  # too little busy time for a pace
    totals.stats.num_tokens_to_compute, totals.stats.num_output_tokens_left = 396, 96
    pace = rate.sample()
    assert pace.tokens_per_s is None and pace.work_left == WorkLeft(4, 396, 96)
    totals.run(num_steps=100, tokens=400, seconds=1.0)
    totals.stats.num_requests_left = totals.stats.num_tokens_to_compute = 0
    totals.stats.num_output_tokens_left = 0
    pace = rate.sample()
    assert pace.tokens_per_s is not None and pace.work_left == WorkLeft(0, 0, 0)


def test_the_pace_counts_the_time_between_steps_while_work_waits() -> None:
    """1,000 tokens in 1 s of steps, with 0.25 s of the worker's own work between them:
    800 tokens/s is what the worker gets through, and 12.5 ms a step what a sequence
    waits."""
    totals = Totals()
    rate = ServiceRate(totals)
    rate.sample()
    totals.run(num_steps=100, tokens=1000, seconds=1.0)
    totals.stats.loaded_seconds += 1.25
    pace = rate.sample()
    assert pace.tokens_per_s == pytest.approx(800.0)
    assert pace.step_s == pytest.approx(0.0125)


def test_the_pace_ahead_is_the_work_held_over_its_predicted_time() -> None:
    """The engine holds 3,000 tokens it should get through in 2 s of steps; with a
    quarter more time between steps measured, 3,000 / 2.5 = 1,200 tokens/s is reported
    in place of the measured 800. With nothing held, the measured pace."""
    totals = Totals()
    rate = ServiceRate(totals)
    rate.sample()
    totals.run(num_steps=1000, tokens=1000, seconds=1.0)
    totals.stats.loaded_seconds += 1.25
    totals.stats.num_tokens_to_compute, totals.stats.predicted_seconds_left = 3000, 2.0
    pace = rate.sample()
    assert pace.tokens_per_s == pytest.approx(800.0)
    assert pace.tokens_per_s_ahead == pytest.approx(3000 / (2.0 * 1.25), rel=1e-3)
    assert pace.reported_tokens_per_s == pace.tokens_per_s_ahead
    totals.stats.num_tokens_to_compute, totals.stats.predicted_seconds_left = 0, None
    pace = rate.sample()
    assert pace.tokens_per_s_ahead is None and pace.reported_tokens_per_s == pace.tokens_per_s


def test_the_step_alone_is_stretched_as_the_pace_and_kept_while_idle() -> None:
    """The engine's fitted one-sequence step of 8 ms, with a quarter more time between
    steps measured: 10 ms; holding nothing later, the 10 ms it last knew."""
    totals = Totals()
    rate = ServiceRate(totals)
    rate.sample()
    totals.run(num_steps=1000, tokens=1000, seconds=1.0)
    totals.stats.loaded_seconds += 1.25
    totals.stats.solo_step_seconds = 0.008
    assert rate.sample().solo_step_s == pytest.approx(0.010, rel=1e-3)
    totals.stats.solo_step_seconds = None
    assert rate.sample().solo_step_s == pytest.approx(0.010, rel=1e-3)


def test_holding_nothing_the_pace_is_a_full_batch_of_jobs_like_the_last() -> None:
    """A wave's narrow tail measured 800 tokens/s; a full batch of such jobs runs 2,000
    by the engine's fitted cost, a quarter more with the time between steps: 1,600 is
    reported for the next work, not the tail's pace (but never less than it). Holding
    work, that work's pace."""
    totals = Totals()
    rate = ServiceRate(totals)
    rate.sample()
    totals.run(num_steps=1000, tokens=1000, seconds=1.0)
    totals.stats.loaded_seconds += 1.25
    totals.stats.full_batch_tokens_per_s = 2000.0
    pace = rate.sample()
    assert pace.tokens_per_s == pytest.approx(800.0)
    assert pace.reported_tokens_per_s == pytest.approx(1600.0, rel=1e-3)
    # An extrapolation below what it measured is not believed over the measurement.
    totals.stats.full_batch_tokens_per_s = 500.0
    assert rate.sample().reported_tokens_per_s == pytest.approx(800.0)
    totals.stats.num_requests_left = 4
    totals.stats.num_tokens_to_compute, totals.stats.predicted_seconds_left = 100, 0.5
    assert rate.sample().reported_tokens_per_s == pytest.approx(100 / (0.5 * 1.25), rel=1e-3)


def test_an_engine_dry_between_two_polls_keeps_the_pace_of_its_work() -> None:
    """Holding a batch's lines at 1,200 tokens/s, then found holding nothing 0.25 s later
    (between two polls of the batch): still 1,200, not the idle engine's full-batch 4,000;
    idle past the dry spell, the full-batch pace for whatever comes next."""
    totals, now = Totals(), [0.0]
    rate = ServiceRate(totals, clock=lambda: now[0])
    totals.stats.full_batch_tokens_per_s = 4000.0
    totals.stats.num_requests_left = 4
    totals.stats.num_tokens_to_compute, totals.stats.predicted_seconds_left = 600, 0.5
    assert rate.sample().reported_tokens_per_s == pytest.approx(1200.0)
    totals.stats.num_requests_left = totals.stats.num_tokens_to_compute = 0
    totals.stats.predicted_seconds_left = None
    now[0] = 0.25
    assert rate.sample().reported_tokens_per_s == pytest.approx(1200.0)
    now[0] = 0.25 + DRY_SPELL_S
    assert rate.sample().reported_tokens_per_s == pytest.approx(4000.0)
