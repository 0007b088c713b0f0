"""The autoscaler's rule: the workers' consumer lag → how many inference workers to run.

Responsible for, on each lag reading (pure: the caller brings the lag and the time):
- weighting each priority's lag and turning the sum into a worker count,
  clamp(ceil(weighted_lag / lag_threshold), min_workers, max_workers), never above the
  job topics' partition count (a worker beyond it would idle) unless min_workers itself
  is higher;
- scaling up at once, and down only once every reading for a whole cooldown asked for
  fewer workers — then to the most any of them asked for, so the count never drops below
  what the lag needed at some moment of the window, and drops at most once per cooldown;
- keeping the count when the lag could not be read: a broker outage is no reason to
  drain workers, nor to count towards a cooldown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from core.settings import Settings


@dataclass(frozen=True, slots=True)
class AutoscalePolicy:
    """The numbers the rule follows (the autoscale_* settings)."""

    min_workers: int
    max_workers: int
    lag_threshold: int
    cooldown_s: float
    # Priority name → weight of its lag; priorities not named here do not count.
    weights: Mapping[str, float]

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 0 <= min_workers <= max_workers, got {self.min_workers} "
                             f"and {self.max_workers}")
        if self.lag_threshold < 1:
            raise ValueError(f"lag_threshold must be >= 1, got {self.lag_threshold}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")
        if any(weight <= 0 for weight in self.weights.values()):
            raise ValueError(f"priority weights must be > 0, got {dict(self.weights)}")

    @classmethod
    def from_settings(cls, settings: Settings) -> AutoscalePolicy:
        """The policy the settings describe."""
        return cls(min_workers=settings.autoscale_min_workers,
                   max_workers=settings.autoscale_max_workers,
                   lag_threshold=settings.autoscale_lag_threshold,
                   cooldown_s=settings.autoscale_cooldown_s,
                   weights=settings.autoscale_weights)

    def num_workers_for(self, weighted_lag: float, num_partitions: int) -> int:
        """Workers this much weighted lag asks for, within the limits."""
        num_wanted = math.ceil(weighted_lag / self.lag_threshold)
        # min_workers is applied last: it is the operator's explicit floor, as KEDA's
        # minReplicaCount is, and spare workers take over a crashed one's partitions.
        return max(self.min_workers, min(num_wanted, self.max_workers, num_partitions))


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """What one reading led to: the count to run from now on, and why."""

    num_workers: int
    num_previous: int
    # Priority → lag × weight; empty when the lag could not be read.
    weighted_lag: dict[str, float]
    reason: str

    @property
    def is_change(self) -> bool:
        """True when the count differs from the one before the reading."""
        return self.num_workers != self.num_previous


class Autoscaler:
    """The rule with its memory: the current count and how long the lag asked for fewer."""

    def __init__(self, policy: AutoscalePolicy, *, num_workers: int) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.policy = policy
        self.num_workers = num_workers
        # When the readings started asking for fewer workers (None: they do not), and the
        # most any of those readings asked for.
        self._lower_since: float | None = None
        self._num_most_wanted_lower = 0

    def observe(
        self, lag: Mapping[str, int], *, num_partitions: int, now: float,
        num_for_deadlines: int = 0,
    ) -> ScaleDecision:
        """Take the reading made at `now`: priority → lag, the most partitions any job
        topic has, and the workers queued deadlines need (see scheduler.deadline_floor)."""
        policy = self.policy
        weighted = {p: lag.get(p, 0) * weight for p, weight in policy.weights.items()}
        total = sum(weighted.values())
        num_wanted = policy.num_workers_for(total, num_partitions)
        why = (f"weighted lag {_number(total)} ("
               + ", ".join(f"{p} {_number(v)}" for p, v in weighted.items())
               + f") at {policy.lag_threshold} per worker asks for {num_wanted}"
               + f" (min {policy.min_workers}, max {policy.max_workers}, "
               + f"{num_partitions} partitions)")
        if num_for_deadlines > num_wanted:
            # Within the same limits as the lag: a worker beyond the partitions would idle.
            num_wanted = policy.num_workers_for(
                num_for_deadlines * policy.lag_threshold, num_partitions)
            why += f"; queued deadlines ask for {num_for_deadlines}, so {num_wanted}"
        num_previous = self.num_workers
        if num_wanted >= num_previous:
            self._lower_since = None
            self.num_workers = num_wanted
            reason = why
        else:
            if self._lower_since is None:
                self._lower_since = now
                self._num_most_wanted_lower = num_wanted
            else:
                self._num_most_wanted_lower = max(self._num_most_wanted_lower, num_wanted)
            waited_s = now - self._lower_since
            if waited_s >= policy.cooldown_s:
                self.num_workers = self._num_most_wanted_lower
                self._lower_since = None
                reason = (f"{why}; no reading asked for more than {self.num_workers} in "
                          f"{waited_s:.0f}s (cooldown {policy.cooldown_s:g}s)")
            else:
                reason = (f"{why}; scale-down to {self._num_most_wanted_lower} waits "
                          f"{policy.cooldown_s - waited_s:.0f}s more")
        return ScaleDecision(self.num_workers, num_previous, weighted, reason)

    def observe_error(self, error: str) -> ScaleDecision:
        """Take a failed reading: keep the count, and start any cooldown over."""
        self._lower_since = None
        return ScaleDecision(self.num_workers, self.num_workers, {},
                             f"lag unreadable ({error}); keeping {self.num_workers} workers")


def _number(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")
