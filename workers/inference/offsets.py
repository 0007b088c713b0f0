"""Which offset each partition may commit: up to the lowest one not yet persisted.

Responsible for: remembering, per assigned partition, the offsets handed to the worker and
not yet acknowledged (their result is not stored yet), the highest offset seen, and the
last offset committed, so that `committable()` returns only partitions whose commit point
moved. Jobs finish out of order (a short job overtakes a long one in the continuous batch),
so the commit point is the first gap, not the latest acknowledgement.

The idea is faust's `Consumer._new_offset`: faust sorts the acknowledged offsets and
commits the end of the first run of consecutive numbers. Worked example, one partition
whose records 34..40 were polled, with 34, 35, 36 and 40 persisted and 37..39 still in the
engine:

    acked:    34 35 36 .. .. .. 40
    pending:            37 38 39
    commit:   37   (Kafka commits "the next offset to read", i.e. last done + 1)

After a crash the new owner restarts at 37: it re-runs 37..39 (never persisted) and sees
40 again, which it skips because the job is already finished. Nothing is lost, and the
idempotent result write keeps 40 from being stored twice.

Unlike faust, this tracker keeps the *pending* offsets (received, not yet acknowledged)
rather than the acknowledged ones, and commits `min(pending)`, or `highest seen + 1` when
nothing is pending. The two agree on the example above, but this way the holes Kafka
itself leaves in a partition (compacted records, transaction markers) never look like a
missing acknowledgement, so faust's extra bookkeeping of known gaps is not needed.
"""

from __future__ import annotations

import heapq
import logging

from kafka import TopicPartition

logger = logging.getLogger(__name__)


class PartitionOffsets:
    """Offsets of one partition: pending ones, the highest seen, the last committed."""

    def __init__(self) -> None:
        self.pending: set[int] = set()
        # The pending offsets as a heap, acknowledged ones removed lazily from its top: a
        # worker holds thousands, and min() over the set at every commit check showed in
        # its profile.
        self._lowest: list[int] = []
        self.highest_seen: int | None = None
        self.committed: int | None = None

    def track(self, offset: int) -> None:
        """A record at `offset` was handed to the worker and is not persisted yet."""
        if self.committed is not None and offset < self.committed:
            # Redelivered below our own commit point (a seek back): already done.
            return
        if offset not in self.pending:
            self.pending.add(offset)
            heapq.heappush(self._lowest, offset)
        if self.highest_seen is None or offset > self.highest_seen:
            self.highest_seen = offset

    def ack(self, offset: int) -> None:
        """The record at `offset` is persisted (or needs no work); unknown offsets are ignored."""
        self.pending.discard(offset)

    @property
    def commit_point(self) -> int | None:
        """The offset to commit: lowest pending, else highest seen + 1; None if nothing seen."""
        lowest = self._lowest
        while lowest and lowest[0] not in self.pending:
            heapq.heappop(lowest)
        if lowest:
            return lowest[0]
        if self.highest_seen is None:
            return None
        return self.highest_seen + 1


class OffsetTracker:
    """Per-partition commit points for the partitions this worker owns."""

    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, PartitionOffsets] = {}

    def assign(self, partitions: set[TopicPartition]) -> None:
        """Start tracking newly assigned partitions (state of kept ones is preserved)."""
        for tp in partitions:
            self._partitions.setdefault(tp, PartitionOffsets())

    def revoke(self, partitions: set[TopicPartition]) -> None:
        """Forget partitions this worker no longer owns; their late acks are ignored."""
        for tp in partitions:
            self._partitions.pop(tp, None)

    def owns(self, tp: TopicPartition) -> bool:
        """Whether `tp` is currently tracked (assigned to this worker)."""
        return tp in self._partitions

    def track(self, tp: TopicPartition, offset: int) -> None:
        """Record that `offset` of `tp` was received and awaits persisting."""
        partition = self._partitions.get(tp)
        if partition is None:
            logger.debug("record %s@%d from a partition not assigned here", tp, offset)
            return
        partition.track(offset)

    def ack(self, tp: TopicPartition, offset: int) -> None:
        """Record that `offset` of `tp` is persisted (no-op for partitions not owned)."""
        partition = self._partitions.get(tp)
        if partition is not None:
            partition.ack(offset)

    def num_pending(self) -> int:
        """Offsets received and not yet acknowledged, over all partitions."""
        return sum(len(p.pending) for p in self._partitions.values())

    def committable(
        self, partitions: set[TopicPartition] | None = None
    ) -> dict[TopicPartition, int]:
        """Partitions (optionally only `partitions`) whose commit point moved → that point."""
        moved: dict[TopicPartition, int] = {}
        for tp, partition in self._partitions.items():
            if partitions is not None and tp not in partitions:
                continue
            point = partition.commit_point
            if point is not None and (partition.committed is None or point > partition.committed):
                moved[tp] = point
        return moved

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        """Remember what the broker accepted, so the same points are not committed again."""
        for tp, offset in offsets.items():
            partition = self._partitions.get(tp)
            if partition is not None:
                partition.committed = offset
