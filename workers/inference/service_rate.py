"""A worker's measured pace, for the estimates the API shows (queue position, ETAs).

Responsible for turning the engine's running totals into two figures between heartbeats:
tokens computed per second of having work (the throughput the work ahead is divided by)
and seconds per engine step (what one sequence waits per token, the floor of a job's own
duration). "Having work" is the engine's loaded time: its steps and the worker's time
between them (outputs handed on, results stored, requests taken in), which every step
costs too; tokens per second inside steps alone ran 12% above what the tiny model's worker
got through, and put its batch ETAs 10-30% early (bench/eta_accuracy.py). Engines that do
not count loaded time (the embedding engine) are measured by their busy time.
Both are smoothed over engine steps, not heartbeats: an interval of n steps weighs
1 - exp(-n / SMOOTHING_STEPS) against the figures so far. A job lives for dozens of steps
(its prefill, then one step per output token), and tokens per second swing within that
life: prefill chunks run thousands of tokens a step, decode steps one per sequence. On a
CPU where a full batch's step takes seconds, a heartbeat sees one or two steps, and
weighing each beat the same made the pace follow whichever kind of step it caught
(SmolLM2, bench/eta_accuracy.py: batch ETAs from -36% to +136%). On a fast engine a beat
spans hundreds of steps and the pace follows at once. Figures only move after enough
loaded time to mean something; an idle worker keeps its last ones, as its capacity has not
changed.

Beside the pace, each sample carries the work the engine's live requests have left, as
the engine counts it then (not smoothed: it is a level, not a rate): the estimates count
a worker's running jobs by it rather than as whole jobs (see storage.queue_estimates).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from workers.engine.outputs import EngineStats

# Less busy time than this between two samples says little about the pace.
MIN_BUSY_S = 0.2
# Engine steps over which the figures are smoothed (about a job's life: see above).
SMOOTHING_STEPS = 64.0
# An engine that held work this recently and holds none now ran dry between two polls of a
# batch, not out of work: its pace ahead stays the one of the work it held. Taking the
# full-batch pace of an idle engine then put a running tiny-model batch's estimates at
# twice its pace or more, each time a sample caught the engine between polls.
DRY_SPELL_S = 1.0


@dataclass(frozen=True, slots=True)
class WorkLeft:
    """What an engine's live requests have left (see `EngineStats`)."""

    num_requests: int
    num_tokens_to_compute: int
    num_output_tokens: int

    @classmethod
    def of(cls, stats: EngineStats) -> WorkLeft:
        """The work left in a stats snapshot."""
        return cls(stats.num_requests_left, stats.num_tokens_to_compute,
                   stats.num_output_tokens_left)


@dataclass(frozen=True, slots=True)
class Pace:
    """Measured figures; None until the engine has been busy long enough. `work_left`:
    the engine's at the last sample (None before the first)."""

    tokens_per_s: float | None = None
    step_s: float | None = None
    work_left: WorkLeft | None = None
    # The pace at which the engine should get through the work it holds now: its tokens
    # over the seconds the fitted step cost gives for them at the widths its batch will
    # run (workers.engine.work_left), stretched by the measured share of time between
    # steps; while it holds nothing, the pace of a full batch of jobs shaped as the
    # finished ones, stretched alike. None until its cost is fitted.
    tokens_per_s_ahead: float | None = None
    # A decode step of one sequence alone (the engine's fitted cost, stretched as the
    # pace ahead is); the last one known while the engine holds nothing.
    solo_step_s: float | None = None

    @property
    def reported_tokens_per_s(self) -> float | None:
        """What the heartbeat reports: the pace ahead where known, else the measured one."""
        return self.tokens_per_s_ahead or self.tokens_per_s


class ServiceRate:
    """Samples an engine's totals into a smoothed `Pace` (safe from any thread)."""

    def __init__(self, stats: Callable[[], EngineStats],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stats = stats
        self._clock = clock
        self._held_at = -math.inf  # when a sample last found the engine holding work
        self._lock = threading.Lock()
        self._last: EngineStats | None = None
        self._pace = Pace()
        # Loaded over busy seconds (>= 1), smoothed as the pace: what each step also costs
        # the worker between steps.
        self._overhead = 1.0

    def sample(self) -> Pace:
        """Take the engine's totals now and return the updated pace."""
        stats = self._stats()
        with self._lock:
            self._pace = replace(self._pace, work_left=WorkLeft.of(stats),
                                 tokens_per_s_ahead=self._pace_ahead(stats),
                                 solo_step_s=self._solo_step(stats))
            last, self._last = self._last, stats
            if last is None:
                self._last = stats
                return self._pace
            # Wall time with work, where the engine counts it: the time between steps is
            # the worker's own, spent on every step (outputs, results, new requests).
            busy = (stats.loaded_seconds - last.loaded_seconds if stats.loaded_seconds
                    else stats.busy_seconds - last.busy_seconds)
            if busy < MIN_BUSY_S:
                self._last = last  # keep accumulating from the earlier sample
                return self._pace
            tokens_per_s = (stats.num_computed_tokens - last.num_computed_tokens) / busy
            num_steps = stats.num_steps - last.num_steps
            step_s = busy / num_steps if num_steps > 0 else None
            weight = 1 - math.exp(-max(num_steps, 1) / SMOOTHING_STEPS)
            busy_only = stats.busy_seconds - last.busy_seconds
            if stats.loaded_seconds and busy_only > 0:
                self._overhead = max(1.0, (1 - weight) * self._overhead
                                     + weight * busy / busy_only)
            self._pace = Pace(
                _smooth(self._pace.tokens_per_s, tokens_per_s, weight),
                _smooth(self._pace.step_s, step_s, weight),
                self._pace.work_left,
                self._pace_ahead(stats),
                self._solo_step(stats),
            )
            return self._pace

    def _pace_ahead(self, stats: EngineStats) -> float | None:
        now = self._clock()
        if stats.num_requests_left > 0:
            self._held_at = now
        elif now - self._held_at < DRY_SPELL_S:
            return self._pace.tokens_per_s_ahead
        if stats.num_requests_left <= 0 and stats.full_batch_tokens_per_s:
            # Holding nothing: the next work is new work, as a batch's lines are, and it
            # runs at the width it fills, not at the pace of whatever ran last, often a
            # narrow tail; but no slower than that pace either, which was measured where
            # the full batch's is extrapolated (from narrow steps alone the fitted cost
            # put a tiny model's full batch at 30,700 tokens/s; it ran 40,400).
            return max(stats.full_batch_tokens_per_s / self._overhead,
                       self._pace.tokens_per_s or 0.0)
        seconds = stats.predicted_seconds_left
        if not seconds or seconds <= 0 or stats.num_tokens_to_compute <= 0:
            return None
        return stats.num_tokens_to_compute / (seconds * self._overhead)

    def _solo_step(self, stats: EngineStats) -> float | None:
        seconds = stats.solo_step_seconds
        if not seconds or seconds <= 0:
            return self._pace.solo_step_s  # holding nothing: the step it last knew
        return seconds * self._overhead


def _smooth(old: float | None, new: float | None, weight: float) -> float | None:
    if new is None:
        return old
    if old is None:
        return new
    return (1 - weight) * old + weight * new
