"""Estimate arithmetic: order, work ahead, the own-duration floor, cache hits free."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from storage.estimates import LoadReading
from storage.queue_estimates import ModelQueue, queue_key, workers_for_deadlines

T0 = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)
NOW = T0.timestamp() + 100


def reading(**kw: object) -> LoadReading:
    base: dict[str, object] = {"num_workers": 1, "tokens_per_s": 1000.0, "step_s": 0.02,
                               "mean_prompt_tokens": 50.0, "mean_completion_tokens": 150.0}
    return LoadReading(**(base | kw))  # type: ignore[arg-type]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_the_docstring_example_without_a_report_of_the_work_left() -> None:
    """Rate 1,000 tok/s, 200 tokens a job (150 out), step 20 ms, 2 running (no worker says
    what they have left: whole jobs), 9th in line."""
    queued = [("normal", None, at(i)) for i in range(9)]
    queue = ModelQueue.of(reading(queued=queued, running_started=[at(0), at(1)]), NOW)
    estimate = queue.estimate_queued(1, queue_key(None, at(8)), NOW)
    assert estimate.queue_position == 8
    # (8 + 2 + 1) x 200 / 1,000 = 2.2 s, below the job's own 150 x 0.02 = 3.0 s.
    assert estimate.estimated_completion_at == pytest.approx(NOW + 3.0, abs=1e-6)
    assert estimate.estimated_start_at == pytest.approx(NOW, abs=1e-6)


def test_work_ahead_follows_priority_then_deadline_then_creation() -> None:
    queued = (
        [("low", None, at(i)) for i in range(100)]
        + [("high", None, at(200)), ("normal", at(5000), at(300)), ("normal", None, at(1))]
    )
    queue = ModelQueue.of(reading(queued=queued), NOW)
    high = queue.estimate_queued(0, queue_key(None, at(200)), NOW)
    with_deadline = queue.estimate_queued(1, queue_key(at(5000), at(300)), NOW)
    without = queue.estimate_queued(1, queue_key(None, at(1)), NOW)
    last_low = queue.estimate_queued(2, queue_key(None, at(99)), NOW)
    assert [high.queue_position, with_deadline.queue_position, without.queue_position,
            last_low.queue_position] == [0, 1, 2, 102]
    completions = [e.estimated_completion_at or 0.0
                   for e in (high, with_deadline, without, last_low)]
    assert all(completions) and completions == sorted(completions)
    # 103 jobs of 200 tokens at 1,000 tok/s: the last one is done 20.6 s from now.
    assert last_low.estimated_completion_at == pytest.approx(NOW + 20.6, abs=1e-6)


def test_a_new_job_is_placed_after_everything_of_its_priority() -> None:
    queue = ModelQueue.of(reading(queued=[("normal", None, at(i)) for i in range(10)]), NOW)
    new = queue.estimate_queued(1, queue_key(None, at(50)), NOW)
    assert new.queue_position == 10


def test_cache_hits_cost_nothing() -> None:
    queued = [("normal", None, at(i)) for i in range(100)]
    cold = ModelQueue.of(reading(queued=queued), NOW)
    half_cached = ModelQueue.of(reading(queued=queued, cache_hit_fraction=0.5), NOW)
    key = queue_key(None, at(99))
    cold_s = cold.estimate_queued(1, key, NOW).estimated_completion_at
    cached_s = half_cached.estimate_queued(1, key, NOW).estimated_completion_at
    assert cold_s is not None and cached_s is not None
    assert cached_s - NOW == pytest.approx((cold_s - NOW) / 2)


def test_no_measured_worker_gives_a_position_but_no_times() -> None:
    queue = ModelQueue.of(reading(tokens_per_s=None, queued=[("low", None, at(0))]), NOW)
    estimate = queue.estimate_queued(2, queue_key(None, at(0)), NOW)
    assert estimate.queue_position == 0
    assert estimate.estimated_start_at is None and estimate.estimated_completion_at is None
    assert queue.seconds_to_drain() is None


def test_a_running_job_finishes_its_own_run_after_it_started() -> None:
    queue = ModelQueue.of(reading(), NOW)
    estimate = queue.estimate_running(NOW - 1.0, NOW)
    assert estimate.queue_position == 0
    assert estimate.estimated_completion_at == pytest.approx(NOW - 1.0 + 3.0, abs=1e-6)
    # Past its own run: its own 200 tokens at 1,000 tokens/s from now.
    overdue = queue.estimate_running(NOW - 10.0, NOW)
    assert overdue.estimated_completion_at == pytest.approx(NOW + 0.2, abs=1e-6)


def test_defaults_before_anything_finished() -> None:
    queue = ModelQueue.of(reading(mean_prompt_tokens=None, mean_completion_tokens=None), NOW)
    assert queue.work_per_job == 64 + 128


def test_workers_for_deadlines_from_the_pace_per_worker() -> None:
    """Two workers at 500 tok/s each; 100 jobs of 200 tokens due in 10 s need 2,000 tok/s:
    4 workers. Due in a day: the ones there are (1 suffices)."""
    due_soon = [("normal", at(100 + 10), at(i)) for i in range(100)]
    queue = ModelQueue.of(reading(num_workers=2, queued=due_soon), NOW)
    assert workers_for_deadlines(queue, now=NOW) == 4
    due_late = [("normal", at(100 + 86_400), at(i)) for i in range(100)]
    assert workers_for_deadlines(ModelQueue.of(reading(num_workers=2, queued=due_late),
                                               NOW), now=NOW) == 1
    no_deadlines = [("normal", None, at(i)) for i in range(100)]
    assert workers_for_deadlines(ModelQueue.of(reading(num_workers=2, queued=no_deadlines),
                                               NOW), now=NOW) == 0
    assert workers_for_deadlines(ModelQueue.of(reading(tokens_per_s=None, queued=due_soon),
                                               NOW), now=NOW) == 0


def test_lines_not_yet_enqueued_follow_at_the_models_pace_or_the_tenants_budget() -> None:
    """100 lines of 200 tokens at 1,000 tokens/s: 20 s after the queued work; a budget of
    6,000 tokens a minute (100/s) stretches them to 200 s from now."""
    queue = ModelQueue.of(reading(), NOW)
    assert queue.finish_unqueued(NOW + 5, NOW,
                                 num_unqueued=100) == pytest.approx(NOW + 25, abs=1e-6)
    # 50 lines of a nearer deadline enqueued first: 10 s more; the budget is this batch's.
    assert queue.finish_unqueued(NOW + 5, NOW, num_unqueued=100,
                                 num_ahead=50) == pytest.approx(NOW + 35, abs=1e-6)
    assert queue.finish_unqueued(None, NOW, num_unqueued=100, num_ahead=50,
                                 budget_tokens_per_s=100.0) == pytest.approx(NOW + 200, abs=1e-6)
    assert queue.finish_unqueued(None, NOW, num_unqueued=100,
                                 budget_tokens_per_s=100.0) == pytest.approx(NOW + 200, abs=1e-6)
    idle = ModelQueue.of(reading(tokens_per_s=None), NOW)
    assert idle.finish_unqueued(None, NOW, num_unqueued=1) is None


def test_running_jobs_count_whole_before_a_queued_one() -> None:
    """A worker holds twice the jobs its engine decodes: 100 running and 10 queued jobs of
    200 tokens at 1,000 tokens/s leave the last queued one (110 x 200) / 1,000 = 22 s."""
    queued = [("normal", None, at(i)) for i in range(10)]
    running = [at(-60 + i * 0.1) for i in range(100)]
    queue = ModelQueue.of(reading(queued=queued, running_started=running), NOW)
    last = queue.estimate_queued(1, queue_key(None, at(9)), NOW)
    assert last.estimated_completion_at == pytest.approx(NOW + 22.0, abs=1e-6)
    assert queue.seconds_to_drain() == pytest.approx(22.0)


def test_a_running_job_waits_for_those_claimed_before_it() -> None:
    """Of 100 running jobs claimed one after another, the last finishes after the 99 before
    it and its own work: 100 x 200 / 1,000 = 20 s; the first, its own run from its start."""
    running = [at(-60 + i * 0.1) for i in range(100)]
    queue = ModelQueue.of(reading(running_started=running), NOW)
    last = queue.estimate_running(running[-1].timestamp(), NOW)
    assert last.estimated_completion_at == pytest.approx(NOW + 20.0, abs=1e-6)
    first = queue.estimate_running(running[0].timestamp(), NOW)
    assert first.estimated_completion_at == pytest.approx(NOW + 0.2, abs=1e-6)


def test_jobs_claimed_in_one_instant_stand_half_way_unless_last() -> None:
    """100 jobs claimed by one poll: any one of them is, on average, behind 49.5 of the
    others ((49.5 + 1) x 0.2 = 10.1 s); a batch's last is behind all 99 (20 s)."""
    running = [at(-1)] * 100
    queue = ModelQueue.of(reading(running_started=running), NOW)
    started = running[0].timestamp()
    some = queue.estimate_running(started, NOW)
    assert some.estimated_completion_at == pytest.approx(NOW + 10.1, abs=1e-6)
    last = queue.estimate_running(started, NOW, is_last=True)
    assert last.estimated_completion_at == pytest.approx(NOW + 20.0, abs=1e-6)


def test_a_jobs_own_output_follows_its_max_tokens() -> None:
    """Finished jobs used half their max_tokens: a job allowed 1,000 tokens should write
    500, 500 steps of 20 ms = 10 s on an idle worker; one allowed 100, 50 (below the
    3.0 s of the mean job). Without the share, max_tokens only caps the mean."""
    queue = ModelQueue.of(reading(mean_output_fill=0.5), NOW)
    key = queue_key(None, at(0))
    assert queue.estimate_queued(1, key, NOW, max_tokens=1000).estimated_completion_at \
        == pytest.approx(NOW + 10.0, abs=1e-6)
    assert queue.estimate_queued(1, key, NOW, max_tokens=100).estimated_completion_at \
        == pytest.approx(NOW + 1.0, abs=1e-6)
    assert queue.own_work(100) == pytest.approx(50 + 50)
    unknown = ModelQueue.of(reading(), NOW)
    assert unknown.expected_output(1000) == 150 and unknown.expected_output(16) == 16
    assert unknown.expected_output(None) == 150


def test_a_job_longer_than_the_mean_finishes_its_extra_steps_after_the_work_ahead() -> None:
    """200 queued jobs of 200 tokens (150 out, all of max_tokens) at 1,000 tokens/s, 0.1 s
    a step. A mean job behind them: done when their 40 s of work is (plus its own
    0.2 s). One of 600 tokens starts as the jobs beside it started, 40 - 15 = 25 s from
    now, and decodes 600 steps: 85 s (its own work at the fleet's pace put it at 60 s,
    its bare run)."""
    queued = [("normal", None, at(i)) for i in range(200)]
    queue = ModelQueue.of(reading(queued=queued, step_s=0.1, mean_output_fill=1.0), NOW)
    key = queue_key(None, at(500))
    mean = queue.estimate_queued(1, key, NOW, max_tokens=150)
    assert mean.estimated_completion_at is not None
    assert mean.estimated_completion_at - NOW == pytest.approx(40.2)
    long = queue.estimate_queued(1, key, NOW, max_tokens=600)
    assert long.estimated_start_at is not None and long.estimated_completion_at is not None
    assert long.estimated_start_at - NOW == pytest.approx(25.0)
    assert long.estimated_completion_at - NOW == pytest.approx(85.0)


def test_steps_after_the_other_work_drains_run_alone() -> None:
    """As above with a one-sequence step of 10 ms reported: the 600-token job runs 150
    steps beside the others until their 40 s of work is drained, the other 450 alone in
    4.5 s: 44.5 s. 100 batch lines not enqueued yet keep the batch wide 20 s more: 350
    steps wide, 250 alone: 62.5 s. Alone on an idle fleet: 600 x 10 ms."""
    queued = [("normal", None, at(i)) for i in range(200)]
    base = {"step_s": 0.1, "mean_output_fill": 1.0, "solo_step_s": 0.01}
    key = queue_key(None, at(500))
    queue = ModelQueue.of(reading(queued=queued, **base), NOW)
    done = queue.estimate_queued(1, key, NOW, max_tokens=600).estimated_completion_at
    assert done is not None and done - NOW == pytest.approx(44.5)
    fanning_out = ModelQueue.of(reading(queued=queued, num_unqueued_lines=100, **base), NOW)
    done = fanning_out.estimate_queued(1, key, NOW, max_tokens=600).estimated_completion_at
    assert done is not None and done - NOW == pytest.approx(62.5)
    idle = ModelQueue.of(reading(**base), NOW)
    done = idle.estimate_queued(1, key, NOW, max_tokens=600).estimated_completion_at
    assert done is not None and done - NOW == pytest.approx(6.0)
