"""Telling the batch loop when a worker has run the last of a batch's jobs it held.

Responsible for: after a worker stores what finished, naming the batches of which it
finished jobs and now holds none in flight, at most once per batch every
`MIN_WAKE_GAP_S`; the worker publishes them on the batches' wake channel. A scheduler's
pass counts the batch then, and finalizes it if nothing else is left, instead of at its
next interval: it extrapolates the batch's end from the finished count, and jobs finish
in waves (an engine batch's lines end together), so a 1,000-line batch of the tiny model
was seen completed 0.9 s after its last line (bench/eta_accuracy.py), half again its
run. A batch spread over several workers wakes a pass per worker that drains it, and a
worker between two of the batch's fan-out windows wakes one that finds it unfinished:
a pass costs a few queries, the wait it saves up to an interval.
"""

from __future__ import annotations

from collections.abc import Iterable

# Shortest gap between two wakes for one batch from one worker (seconds).
MIN_WAKE_GAP_S = 0.1
# Batches remembered for the gap above; older entries go when there are more.
MAX_REMEMBERED = 1024


class BatchDrains:
    """Which batches to announce as drained by this worker (see module doc)."""

    def __init__(self) -> None:
        self._woken_at: dict[str, float] = {}  # batch id -> monotonic time of its last wake

    def drained(self, finished: Iterable[str | None], in_flight: Iterable[str | None],
                now: float) -> list[str]:
        """Batch ids among `finished` (the finished jobs' batches) absent from `in_flight`
        (the batches of the jobs still held), not woken within `MIN_WAKE_GAP_S` of `now`."""
        batch_ids = [b for b in dict.fromkeys(finished) if b is not None]
        if not batch_ids:  # jobs of no batch: the jobs held are not looked at
            return []
        held = set(in_flight)
        due = []
        for batch_id in batch_ids:
            if batch_id in held:
                continue
            if now - self._woken_at.get(batch_id, -MIN_WAKE_GAP_S) < MIN_WAKE_GAP_S:
                continue
            self._woken_at[batch_id] = now
            due.append(batch_id)
        if len(self._woken_at) > MAX_REMEMBERED:
            self._woken_at = {b: t for b, t in self._woken_at.items()
                              if now - t < MIN_WAKE_GAP_S}
        return due
