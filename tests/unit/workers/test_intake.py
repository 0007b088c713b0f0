"""The in-flight bound by urgency: less urgent jobs never keep a more urgent record waiting."""

from __future__ import annotations

from kafka import TopicPartition

from core.messages import JobMessage
from workers.inference.intake import (
    InFlightCounts,
    can_overtake,
    can_take_any,
    count_by_rank,
    count_key,
    room_for_rank,
)
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


def test_counts_kept_as_jobs_come_and_go_equal_counts_taken_afresh() -> None:
    """The worker keeps its in-flight counts as jobs start and end rather than recounting
    every turn; whatever the order, they must say what a fresh count says."""
    shapes = [("a", "low")] * 5 + [("b", "low")] * 2 + [("b", "high"), ("not a tenant!", "normal")]
    jobs = [JobMessage(job_id=f"j{i}", tenant_id=tenant, priority=priority, model="m",
                       kind="chat.completion", body={})
            for i, (tenant, priority) in enumerate(shapes)]
    kept = InFlightCounts()
    for job in jobs:
        kept.add(*count_key(job))
    for job in jobs[3:7]:
        kept.remove(*count_key(job))
    left = jobs[:3] + jobs[7:]
    fresh = InFlightCounts(count_key(job) for job in left)
    assert kept.by_rank == fresh.by_rank == count_by_rank([LOW] * 3 + [HIGH, NORMAL])
    assert kept.by_tenant == fresh.by_tenant
    assert (LOW, "b") not in kept.by_tenant  # gone, not a zero that reads as sharing
    # A copy takes candidates without touching the counts it came from.
    candidates = kept.copy()
    candidates.add(LOW, "b")
    assert kept.by_tenant == fresh.by_tenant and candidates.by_tenant[LOW, "b"] == 1
    assert room_for_rank(kept.by_rank, LOW, 8) == 3


def test_a_worker_holding_only_less_urgent_work_can_be_overtaken() -> None:
    """What decides whether the worker may fetch seldom (fetch_wait's long wait)."""
    assert can_overtake(count_by_rank([LOW] * 8), None, 8)
    assert can_overtake(count_by_rank([]), NORMAL, 8)  # a normal backlog, nothing running
    assert not can_overtake(count_by_rank([LOW] * 8), HIGH, 8)  # a high one waits here
    assert not can_overtake(count_by_rank([HIGH, LOW]), None, 8)
    assert not can_overtake(count_by_rank([NORMAL] * 6 + [HIGH] * 8), None, 8)
    assert not can_overtake(count_by_rank([]), None, 8)  # nothing held
