"""The in-flight bound by urgency: less urgent jobs never keep a more urgent record waiting."""

from __future__ import annotations

from kafka import TopicPartition

from workers.inference.intake import can_take_any, count_by_rank, room_for_rank
from workers.inference.loop_pacing import FULL_WAIT_S, POLL_TIMEOUT_MS, finished_wait_s
from workers.inference.prefetch import PrefetchBuffer

HIGH, NORMAL, LOW = 0, 1, 2


def test_room_counts_only_jobs_at_least_as_urgent() -> None:
    counts = count_by_rank([LOW] * 8 + [NORMAL] * 2)
    assert room_for_rank(counts, HIGH, 8) == 8
    assert room_for_rank(counts, NORMAL, 8) == 6
    assert room_for_rank(counts, LOW, 8) == -2


def test_a_worker_full_of_low_jobs_can_still_take_urgent_ones() -> None:
    assert can_take_any(count_by_rank([LOW] * 8), 8)
    assert can_take_any(count_by_rank([NORMAL] * 8), 8)
    assert not can_take_any(count_by_rank([HIGH] * 8), 8)


def test_a_full_worker_polls_as_often_as_a_busy_one_while_urgent_work_could_start() -> None:
    """At the bound the loop used to wait FULL_WAIT_S for a finish before polling, so a high
    record arriving behind a full low batch waited in Kafka up to that long."""
    assert finished_wait_s(8, 8, can_take_more_urgent=False) == FULL_WAIT_S
    waits = [finished_wait_s(8, 8, n, can_take_more_urgent=True) for n in range(20)]
    assert max(waits) == POLL_TIMEOUT_MS / 1000 < FULL_WAIT_S


def test_prefetch_reports_the_rank_it_would_pop() -> None:
    rank = {"p.jobs.high": HIGH, "p.jobs.normal": NORMAL, "p.jobs.low": LOW}
    buffer: PrefetchBuffer[str] = PrefetchBuffer(rank)
    assert buffer.most_urgent_rank() is None
    buffer.add(TopicPartition("p.jobs.low", 0), "l")
    assert buffer.most_urgent_rank() == LOW
    buffer.add(TopicPartition("p.jobs.normal", 0), "n")
    assert buffer.most_urgent_rank() == NORMAL
    assert buffer.pop_most_urgent() == (TopicPartition("p.jobs.normal", 0), "n")
    assert buffer.most_urgent_rank() == LOW
