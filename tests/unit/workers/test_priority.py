"""Priority pause decisions: lower topics wait while a higher one has a backlog."""

from __future__ import annotations

from kafka import TopicPartition

from workers.inference.priority import most_urgent_backlog_rank, partitions_to_pause

RANK = {"p.jobs.high": 0, "p.jobs.normal": 1, "p.jobs.low": 2}
HIGH = {TopicPartition("p.jobs.high", i) for i in range(2)}
NORMAL = {TopicPartition("p.jobs.normal", i) for i in range(2)}
LOW = {TopicPartition("p.jobs.low", i) for i in range(2)}
ALL = HIGH | NORMAL | LOW


def backlog(**by_topic: int) -> dict[TopicPartition, int | None]:
    return {tp: by_topic.get(tp.topic.split(".")[-1], 0) for tp in ALL}


def test_high_backlog_pauses_normal_and_low() -> None:
    assert partitions_to_pause(ALL, backlog(high=3, low=500), RANK) == NORMAL | LOW


def test_normal_backlog_pauses_only_low() -> None:
    assert partitions_to_pause(ALL, backlog(normal=1, low=9), RANK) == LOW


def test_only_low_backlog_pauses_nothing() -> None:
    assert partitions_to_pause(ALL, backlog(low=9), RANK) == set()


def test_no_backlog_or_unknown_backlog_pauses_nothing() -> None:
    assert partitions_to_pause(ALL, backlog(), RANK) == set()
    assert partitions_to_pause(ALL, dict.fromkeys(ALL), RANK) == set()
    assert most_urgent_backlog_rank(ALL, dict.fromkeys(ALL), RANK) is None


def test_full_prefetch_pauses_its_partition_whatever_the_priority() -> None:
    high0 = TopicPartition("p.jobs.high", 0)
    assert partitions_to_pause(ALL, backlog(high=3), RANK, full={high0}) == NORMAL | LOW | {high0}
    assert partitions_to_pause(ALL, backlog(low=3), RANK, full=ALL) == ALL


def test_one_backlogged_high_partition_is_enough() -> None:
    one = {tp: (4 if tp == TopicPartition("p.jobs.high", 1) else 0) for tp in ALL}
    assert most_urgent_backlog_rank(ALL, one, RANK) == 0
    assert partitions_to_pause(ALL, one, RANK) == NORMAL | LOW


def test_only_assigned_partitions_are_considered() -> None:
    # This worker owns no high partition: another worker drains high, this one keeps
    # serving what it owns.
    assigned = NORMAL | LOW
    assert partitions_to_pause(assigned, backlog(high=50, low=5), RANK) == set()
    assert partitions_to_pause(assigned, backlog(high=1), RANK, full=HIGH) == set()
