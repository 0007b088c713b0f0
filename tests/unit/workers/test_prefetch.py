"""Prefetch buffer: most urgent priority first, FIFO within a priority, per-partition counts."""

from __future__ import annotations

from kafka import TopicPartition

from workers.inference.prefetch import PrefetchBuffer

RANK = {"p.jobs.high": 0, "p.jobs.normal": 1, "p.jobs.low": 2}
HIGH = TopicPartition("p.jobs.high", 0)
LOW0 = TopicPartition("p.jobs.low", 0)
LOW1 = TopicPartition("p.jobs.low", 1)


def test_most_urgent_first_and_fifo_within_a_priority() -> None:
    buffer: PrefetchBuffer[str] = PrefetchBuffer(RANK)
    for tp, record in [(LOW0, "l1"), (LOW1, "l2"), (HIGH, "h1"), (LOW0, "l3"), (HIGH, "h2")]:
        buffer.add(tp, record)
    taken = []
    while (item := buffer.pop_most_urgent()) is not None:
        taken.append(item[1])
    assert taken == ["h1", "h2", "l1", "l2", "l3"]
    assert len(buffer) == 0


def test_counts_follow_adds_and_pops() -> None:
    buffer: PrefetchBuffer[int] = PrefetchBuffer(RANK)
    buffer.add(LOW0, 1)
    buffer.add(LOW0, 2)
    buffer.add(HIGH, 3)
    assert buffer.counts() == {LOW0: 2, HIGH: 1}
    assert buffer.pop_most_urgent() == (HIGH, 3)
    assert buffer.counts() == {LOW0: 2}


def test_clear_drops_everything() -> None:
    buffer: PrefetchBuffer[int] = PrefetchBuffer(RANK)
    buffer.add(LOW0, 1)
    buffer.add(HIGH, 2)
    assert buffer.clear() == 2
    assert len(buffer) == 0 and buffer.counts() == {}
    assert buffer.pop_most_urgent() is None
