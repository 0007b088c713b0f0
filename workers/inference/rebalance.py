"""The worker's rebalance listener: commit what is safe, forget what is gone, re-pause.

Responsible for: on revocation, committing each revoked partition's commit point (so the
next owner redelivers as little finished work as possible) and dropping its offset state;
on assignment, starting offset state for the new partitions, re-applying priority pauses
(a rebalance forgets them, and the consumer fetches right after this callback returns),
and telling the poll thread which partitions it now owns, so it can release in-flight
jobs whose partitions moved to another worker.

kafka-python 3 runs these callbacks on its network thread, where a blocking call
(`commit()`) is refused; `commit_async` only schedules the request, so it works on both
2.x (callbacks inside `poll`) and 3.x. The poll thread is inside `poll()` or `close()`
whenever a rebalance runs, and the offset state is guarded by a lock regardless.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from workers.inference.offsets import OffsetTracker
from workers.inference.priority import PriorityPauser

logger = logging.getLogger(__name__)


def offsets_to_commit(points: dict[TopicPartition, int]) -> dict[TopicPartition, Any]:
    """Commit points as kafka-python's `{TopicPartition: OffsetAndMetadata}`."""
    return {tp: OffsetAndMetadata(offset, "", -1) for tp, offset in points.items()}


class RebalanceListener(ConsumerRebalanceListener):
    """Keeps offsets, pauses and in-flight ownership right across rebalances."""

    def __init__(
        self,
        consumer: KafkaConsumer,
        tracker: OffsetTracker,
        lock: threading.Lock,
        pauser: PriorityPauser,
    ) -> None:
        self._consumer = consumer
        self._tracker = tracker
        self._lock = lock
        self._pauser = pauser
        self._new_assignment: set[TopicPartition] | None = None
        self.num_rebalances = 0

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        """Commit the revoked partitions' commit points, then forget them."""
        partitions = set(revoked)
        with self._lock:
            points = self._tracker.committable(partitions)
            self._tracker.revoke(partitions)
        if points:
            self._consumer.commit_async(offsets_to_commit(points), callback=_log_commit)
        logger.info("partitions revoked: %s", sorted(map(_name, partitions)))

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        """Track the new partitions and pause them as the last priority decision says."""
        partitions = set(assigned)
        with self._lock:
            self._tracker.assign(partitions)
            self._new_assignment = partitions
            self.num_rebalances += 1
        self._pauser.reapply(self._consumer, partitions)
        logger.info("partitions assigned: %s", sorted(map(_name, partitions)))

    def on_partitions_lost(self, lost: Iterable[TopicPartition]) -> None:
        """Forget partitions taken away without a clean revoke; their commits would fail."""
        partitions = set(lost)
        with self._lock:
            self._tracker.revoke(partitions)
        logger.warning(
            "partitions lost (group membership expired): %s", sorted(map(_name, partitions))
        )

    def take_new_assignment(self) -> set[TopicPartition] | None:
        """The assignment made since the last call, if any (for the poll thread)."""
        with self._lock:
            assignment, self._new_assignment = self._new_assignment, None
            return assignment


def _log_commit(offsets: dict[TopicPartition, Any], response: object) -> None:
    if isinstance(response, Exception):
        logger.warning("commit on revocation failed (%s); the next owner redelivers more", response)


def _name(tp: TopicPartition) -> str:
    return f"{tp.topic}/{tp.partition}"
