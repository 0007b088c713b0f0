"""Pausing lower-priority partitions while higher-priority ones have a backlog.

Responsible for: the pause decision (pure functions), and `PriorityPauser`, which measures
backlogs on the consumer, applies the decision after every poll with `pause/resume`, and
re-applies the last decision to a fresh assignment from the rebalance listener, because a
rebalance forgets pauses and an unpaused low-priority partition would be fetched at once.

Rules:
1. Find the most urgent priority with a backlog on an assigned partition; pause every
   partition of a strictly lower priority. That priority and the ones above stay
   fetchable, so new urgent work is seen at once.
2. Pause every partition whose prefetch buffer is full (the worker polled records it has
   no room to start yet). When the worker is at its in-flight bound, its buffers fill and
   everything ends up paused; polls continue, keeping the group membership alive.
3. Otherwise pause nothing, whatever arrives is taken.

Example: assigned high/0, normal/0, low/0 with backlogs 3, 0, 500 → pause normal/0 and
low/0; once high/0's backlog is 0 the most urgent backlog is low's, nothing is paused.

A partition's backlog is what it holds in the prefetch buffer plus what the broker holds
beyond the consumer's position (the fetch high-water mark minus the position, both known
locally after a fetch: no broker round trip per poll). A partition not fetched since it
was assigned keeps the backlog last measured for it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from core.kafka import fetch_position

logger = logging.getLogger(__name__)


def most_urgent_backlog_rank(
    assigned: set[TopicPartition],
    backlog: Mapping[TopicPartition, int | None],
    topic_rank: Mapping[str, int],
) -> int | None:
    """The smallest priority rank with unread records on an assigned partition, or None."""
    ranks = [
        topic_rank[tp.topic]
        for tp in assigned
        if tp.topic in topic_rank and (backlog.get(tp) or 0) > 0
    ]
    return min(ranks, default=None)


def partitions_to_pause(
    assigned: set[TopicPartition],
    backlog: Mapping[TopicPartition, int | None],
    topic_rank: Mapping[str, int],
    *,
    full: set[TopicPartition] | None = None,
) -> set[TopicPartition]:
    """The partitions to keep paused now (see the module docstring for the rules).

    `backlog` maps a partition to its unread record count (None: not known yet);
    `topic_rank` maps a topic to its priority rank (0 is most urgent); `full` holds the
    partitions whose prefetch buffer is at its limit.
    """
    rank = most_urgent_backlog_rank(assigned, backlog, topic_rank)
    return _below(assigned, topic_rank, rank) | (set(full or ()) & assigned)


def _below(
    assigned: set[TopicPartition], topic_rank: Mapping[str, int], rank: int | None
) -> set[TopicPartition]:
    if rank is None:
        return set()
    return {tp for tp in assigned if topic_rank.get(tp.topic, rank) > rank}


class PriorityPauser:
    """Applies the pause rules to a consumer; remembers the last decision for rebalances."""

    def __init__(self, topic_rank: Mapping[str, int]) -> None:
        self.topic_rank = dict(topic_rank)
        self._unfetched: dict[TopicPartition, int] = {}
        self._urgent_rank: int | None = None
        self._is_draining = False

    def update(
        self, consumer: KafkaConsumer, *, prefetched: Mapping[TopicPartition, int], limit: int
    ) -> None:
        """Measure backlogs and pause/resume so that only the right partitions are fetched.

        `prefetched` counts the records each partition has waiting in the worker; a
        partition with `limit` or more is paused until the worker takes some.
        """
        assigned = set(consumer.assignment())
        for tp in assigned:
            measured = _unfetched_of(consumer, tp)
            if measured is not None:
                self._unfetched[tp] = measured
        backlog = {tp: self._unfetched.get(tp, 0) + prefetched.get(tp, 0) for tp in assigned}
        self._urgent_rank = most_urgent_backlog_rank(assigned, backlog, self.topic_rank)
        full = {tp for tp in assigned if prefetched.get(tp, 0) >= limit}
        if self._is_draining:
            full = assigned
        _apply(
            consumer, assigned, partitions_to_pause(assigned, backlog, self.topic_rank, full=full)
        )

    def reapply(self, consumer: KafkaConsumer, assigned: set[TopicPartition]) -> None:
        """Pause a fresh assignment as the last decision said (from the rebalance listener)."""
        if self._is_draining:
            wanted = set(assigned)
        else:
            wanted = _below(assigned, self.topic_rank, self._urgent_rank)
        if wanted:
            consumer.pause(*wanted)
            logger.debug("re-paused %d partitions after rebalance", len(wanted))

    def pause_all(self, consumer: KafkaConsumer) -> None:
        """Stop fetching everything from now on (draining for shutdown)."""
        self._is_draining = True
        assigned = set(consumer.assignment())
        _apply(consumer, assigned, assigned)


def _unfetched_of(consumer: KafkaConsumer, tp: TopicPartition) -> int | None:
    highwater = consumer.highwater(tp)
    if highwater is None:
        return None
    try:
        position = fetch_position(consumer, tp)
    except KafkaError as e:
        logger.debug("no position for %s yet: %s", tp, e)
        return None
    return None if position is None else max(0, highwater - position)


def _apply(
    consumer: KafkaConsumer, assigned: set[TopicPartition], wanted: set[TopicPartition]
) -> None:
    paused = set(consumer.paused()) & assigned
    if to_pause := wanted - paused:
        consumer.pause(*to_pause)
    if to_resume := paused - wanted:
        consumer.resume(*to_resume)

