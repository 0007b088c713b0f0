"""Pausing lower-priority partitions while higher-priority ones have a backlog.

Responsible for: the pause decision (a pure function), and `PriorityPauser`, which measures
backlogs on the consumer, applies the decision after every poll with `pause/resume`, and
re-applies the last decision to a fresh assignment from the rebalance listener, because a
rebalance forgets pauses and an unpaused low-priority partition would be fetched at once.

Rules, in order:
1. The worker is full (in-flight jobs at the bound): pause everything. Polls continue,
   keeping the group membership alive, but fetch nothing.
2. Otherwise find the most urgent priority with a backlog on an assigned partition;
   pause every partition of a strictly lower priority. Partitions of that priority and
   above stay fetchable, so new urgent work is seen at once.
3. No backlog anywhere: pause nothing, whatever arrives is taken.

Example: assigned high/0, normal/0, low/0 with backlogs 3, 0, 500 → pause normal/0 and
low/0; once high/0's backlog is 0 the most urgent backlog is low's, nothing is paused.

Backlog is the fetch high-water mark minus the consumer's position, both known locally
after a fetch (no broker round trip per poll). A partition not fetched since it was
assigned keeps the backlog last measured for it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

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
    is_full: bool,
) -> set[TopicPartition]:
    """The partitions to keep paused now (see the module docstring for the rules).

    `backlog` maps a partition to its unread record count (None: not known yet);
    `topic_rank` maps a topic to its priority rank (0 is most urgent).
    """
    if is_full:
        return set(assigned)
    rank = most_urgent_backlog_rank(assigned, backlog, topic_rank)
    return _below(assigned, topic_rank, rank)


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
        self._backlog: dict[TopicPartition, int] = {}
        self._urgent_rank: int | None = None
        self._is_full = False

    def update(self, consumer: KafkaConsumer, *, is_full: bool) -> None:
        """Measure backlogs and pause/resume so that only the right partitions are fetched."""
        assigned = set(consumer.assignment())
        for tp in assigned:
            measured = _backlog_of(consumer, tp)
            if measured is not None:
                self._backlog[tp] = measured
        self._is_full = is_full
        self._urgent_rank = most_urgent_backlog_rank(assigned, self._backlog, self.topic_rank)
        wanted = partitions_to_pause(assigned, self._backlog, self.topic_rank, is_full=is_full)
        _apply(consumer, assigned, wanted)

    def reapply(self, consumer: KafkaConsumer, assigned: set[TopicPartition]) -> None:
        """Pause a fresh assignment as the last decision said (from the rebalance listener)."""
        wanted = (
            set(assigned) if self._is_full else _below(assigned, self.topic_rank, self._urgent_rank)
        )
        if wanted:
            consumer.pause(*wanted)
            logger.debug("re-paused %d partitions after rebalance", len(wanted))

    def pause_all(self, consumer: KafkaConsumer) -> None:
        """Stop fetching everything (draining for shutdown)."""
        self._is_full = True
        assigned = set(consumer.assignment())
        _apply(consumer, assigned, assigned)


def _backlog_of(consumer: KafkaConsumer, tp: TopicPartition) -> int | None:
    highwater = consumer.highwater(tp)
    if highwater is None:
        return None
    try:
        position = consumer.position(tp)
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
