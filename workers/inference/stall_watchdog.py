"""Defence in depth against a silent stall: assigned partitions that hold records yet yield none.

Responsible for: remembering when each assigned partition last yielded records; once one
has been silent for `stall_after_s` although it may be fetched (not paused, or paused
while the worker has nothing to do, when no pause is justified), asking the broker for
its end offset; when records lie beyond the consumer's position, logging why, counting it
in `batchinfer_worker_fetch_stalls_total`, and restarting the partition's fetch from its
committed offset (parked records dropped, position reset, partition resumed).

Why: a queue that stops delivering while work waits is the worst failure it can have,
and it is silent: the worker looks alive and idle. The one cause found so far is fixed
where it is triggered (`parked_records`); this catches whatever else (a client library
or broker quirk not yet known) in `stall_after_s` instead of never. Restarting from the
committed offset is what a new owner of the partition would do, so it is safe with the
worker's at-least-once bookkeeping: finished jobs seen again are skipped, running ones
re-attach to their records.

Cost: one ListOffsets request per silent partition per `stall_after_s`, none while
records flow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from core import metrics
from workers.inference.parked_records import release_parked_records

logger = logging.getLogger(__name__)

# Seconds between two looks at the partitions' clocks (the look itself is cheap).
CHECK_INTERVAL_S = 1.0


class StallWatchdog:
    """Detects and restarts partitions that stopped yielding records (see module docstring)."""

    def __init__(
        self,
        consumer: KafkaConsumer,
        *,
        stall_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._consumer = consumer
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._progress_at: dict[TopicPartition, float] = {}
        self._checked_at = clock()
        self.num_recoveries = 0

    def on_assigned(self, partitions: Iterable[TopicPartition]) -> None:
        """A new assignment: every partition's clock starts now."""
        now = self._clock()
        self._progress_at = dict.fromkeys(partitions, now)

    def on_records(self, partitions: Iterable[TopicPartition]) -> None:
        """These partitions yielded records just now."""
        now = self._clock()
        for tp in partitions:
            self._progress_at[tp] = now

    def check(self, *, is_idle: bool) -> set[TopicPartition]:
        """Restart partitions stalled with a backlog; the ones restarted.

        `is_idle`: nothing in flight and nothing prefetched, so no pause is justified.
        """
        now = self._clock()
        if now - self._checked_at < CHECK_INTERVAL_S:
            return set()
        self._checked_at = now
        assigned = self._consumer.assignment()
        paused = self._consumer.paused()
        silent = set()
        for tp in assigned:
            since = self._progress_at.setdefault(tp, now)
            if tp in paused and not is_idle:
                self._progress_at[tp] = now  # paused on purpose: its silence is ours
            elif now - since >= self.stall_after_s:
                silent.add(tp)
        if not silent:
            return set()
        stalled = self._with_backlog(silent)
        for tp in silent - set(stalled):
            self._progress_at[tp] = now  # silent because empty: look again much later
        if stalled:
            self._restart(stalled, paused)
        return set(stalled)

    def _with_backlog(self, partitions: set[TopicPartition]) -> dict[TopicPartition, str]:
        """Partitions holding records beyond the consumer's position → a line saying so."""
        try:
            end_offsets = self._consumer.end_offsets(list(partitions))
        except KafkaError as e:
            logger.warning("cannot read end offsets to check for a stall: %s", e)
            return {}
        stalled: dict[TopicPartition, str] = {}
        for tp in partitions:
            end = end_offsets.get(tp)
            try:
                position = self._consumer.position(tp)
            except KafkaError:
                position = None
            if end is not None and position is not None and end > position:
                stalled[tp] = f"{tp.topic}/{tp.partition} at {position} of {end}"
        return stalled

    def _restart(self, stalled: dict[TopicPartition, str], paused: set[TopicPartition]) -> None:
        logger.warning(
            "fetch stall: %s yielded no records for %.0f s although records wait beyond "
            "the position; restarting from the committed offsets",
            ", ".join(sorted(stalled.values())), self.stall_after_s,
        )
        partitions = set(stalled)
        release_parked_records(self._consumer, partitions)
        for tp in partitions:
            try:
                committed = self._consumer.committed(tp)
            except KafkaError as e:
                logger.warning("cannot read the committed offset of %s: %s", tp, e)
                continue
            if committed is None:
                self._consumer.seek_to_beginning(tp)
            else:
                self._consumer.seek(tp, committed)
            metrics.WORKER_FETCH_STALLS.labels(tp.topic).inc()
        if to_resume := partitions & paused:
            self._consumer.resume(*to_resume)
        now = self._clock()
        for tp in partitions:
            self._progress_at[tp] = now
        self.num_recoveries += 1
