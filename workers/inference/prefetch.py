"""Records polled from Kafka and not yet started, handed out most urgent first.

Why a buffer: the consumer's fetcher hands back one partition's fetched records before it
looks at the next partition's response, so a worker that polled only as many records as
it had room for would drain a whole low-priority fetch before it even saw a high-priority
record that arrived meanwhile. Polling everything that is fetched into this buffer and
starting jobs from it in priority order keeps urgent work first; per-partition limits
(applied as pauses, see `priority`) keep it small.

A buffered record is tracked as pending by the offset tracker, so the commit point never
passes it: dropping the buffer (on rebalance or shutdown) only means Kafka redelivers it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from typing import Generic, TypeVar

from kafka import TopicPartition

RecordT = TypeVar("RecordT")


class PrefetchBuffer(Generic[RecordT]):
    """FIFO queues of (partition, record), one per priority rank."""

    def __init__(self, topic_rank: Mapping[str, int]) -> None:
        self._topic_rank = dict(topic_rank)
        num_ranks = max(self._topic_rank.values(), default=0) + 1
        self._queues: list[deque[tuple[TopicPartition, RecordT]]] = [
            deque() for _ in range(num_ranks)
        ]
        self._counts: Counter[TopicPartition] = Counter()

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)

    def add(self, tp: TopicPartition, record: RecordT) -> None:
        """Queue a record behind the others of its priority."""
        rank = self._topic_rank.get(tp.topic, len(self._queues) - 1)
        self._queues[rank].append((tp, record))
        self._counts[tp] += 1

    def most_urgent_rank(self) -> int | None:
        """The priority rank `pop_most_urgent` would take from, or None if empty."""
        return next((rank for rank, queue in enumerate(self._queues) if queue), None)

    def pop_most_urgent(self) -> tuple[TopicPartition, RecordT] | None:
        """The oldest record of the most urgent non-empty priority, or None if empty."""
        for queue in self._queues:
            if queue:
                tp, record = queue.popleft()
                self._counts[tp] -= 1
                if not self._counts[tp]:
                    del self._counts[tp]
                return tp, record
        return None

    def counts(self) -> dict[TopicPartition, int]:
        """Partition → records it has waiting here."""
        return dict(self._counts)

    def drop(self, partitions: set[TopicPartition]) -> int:
        """Drop the records of these partitions (Kafka redelivers them); how many."""
        dropped = 0
        for queue in self._queues:
            kept = [(tp, record) for tp, record in queue if tp not in partitions]
            dropped += len(queue) - len(kept)
            queue.clear()
            queue.extend(kept)
        for tp in partitions:
            self._counts.pop(tp, None)
        return dropped

    def clear(self) -> int:
        """Drop everything (Kafka redelivers it); how many records were dropped."""
        dropped = len(self)
        for queue in self._queues:
            queue.clear()
        self._counts.clear()
        return dropped
