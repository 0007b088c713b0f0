"""Fair share at the worker's intake: deficit round robin over tenants within a priority,
by weight; a lone tenant takes every start; the tenant read from a record's value."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kafka import TopicPartition

from core.messages import JobMessage
from workers.inference.intake import InFlightCounts
from workers.inference.prefetch import PrefetchBuffer
from workers.inference.tenant_share import TenantWeights, message_tenant, record_tenant

RANK = {"p.jobs.high": 0, "p.jobs.normal": 1, "p.jobs.low": 2}
HIGH = TopicPartition("p.jobs.high", 0)
NORMAL0 = TopicPartition("p.jobs.normal", 0)
NORMAL1 = TopicPartition("p.jobs.normal", 1)


def drain(buffer: PrefetchBuffer[str]) -> list[str]:
    taken = []
    while (item := buffer.pop_most_urgent()) is not None:
        taken.append(item[1])
    return taken


def tenant_of(record: str) -> str:
    return record[0]


def test_a_big_batch_and_a_small_tenant_alternate_within_a_priority() -> None:
    """A's 6 records came first, B's 2 after: B's start second and fourth, not last."""
    buffer: PrefetchBuffer[str] = PrefetchBuffer(RANK, tenant_of=tenant_of)
    for i in range(6):
        buffer.add(NORMAL0, f"a{i}")
    buffer.add(NORMAL1, "b0")
    buffer.add(NORMAL0, "b1")
    assert drain(buffer) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]
    assert buffer.counts() == {} and len(buffer) == 0


def test_weights_share_starts_in_proportion() -> None:
    """Weight 3 against 1: three of A's starts per one of B's while both have work."""
    weights = {"a": 3.0, "b": 1.0}
    buffer: PrefetchBuffer[str] = PrefetchBuffer(RANK, tenant_of=tenant_of,
                                                 weight_of=weights.__getitem__)
    for i in range(9):
        buffer.add(NORMAL0, f"a{i}")
    for i in range(3):
        buffer.add(NORMAL0, f"b{i}")
    taken = drain(buffer)
    assert [t[0] for t in taken[:12]] == list("aaabaaabaaab")


def test_priority_comes_before_fair_share_and_a_lone_tenant_takes_all() -> None:
    buffer: PrefetchBuffer[str] = PrefetchBuffer(RANK, tenant_of=tenant_of,
                                                 weight_of=lambda _t: 0.5)
    for i in range(3):
        buffer.add(NORMAL0, f"a{i}")
    buffer.add(HIGH, "b-high")
    assert drain(buffer) == ["b-high", "a0", "a1", "a2"]


def test_drop_forgets_a_tenant_whose_records_all_go() -> None:
    buffer: PrefetchBuffer[str] = PrefetchBuffer(RANK, tenant_of=tenant_of)
    buffer.add(NORMAL0, "a0")
    buffer.add(NORMAL1, "b0")
    buffer.add(NORMAL1, "b1")
    assert buffer.drop({NORMAL1}) == 2
    assert buffer.counts() == {NORMAL0: 1}
    assert drain(buffer) == ["a0"]


@dataclass
class Record:
    value: bytes


def test_record_tenant_reads_the_encoded_message() -> None:
    message = JobMessage(job_id="job_1", tenant_id="ten_abc", priority="normal", model="m",
                         kind="text_completion", body={"prompt": "hi"})
    assert record_tenant(Record(message.encode())) == "ten_abc"
    assert record_tenant(Record(b"not json")) == ""


def test_a_decoded_job_counts_under_the_tenant_its_record_reads_as() -> None:
    """In-flight jobs (decoded) and waiting records (read raw) of one tenant are one."""
    for tenant_id in ("ten_abc", 'quote"d', "x" * 65):
        message = JobMessage(job_id="job_1", tenant_id=tenant_id, priority="normal",
                             model="m", kind="text_completion", body={"prompt": "hi"})
        assert message_tenant(tenant_id) == record_tenant(Record(message.encode()))


def test_weights_are_reread_after_the_refresh_and_kept_on_failure() -> None:
    now = [0.0]
    loads: list[dict[str, float] | Exception] = [{"a": 2.0}, RuntimeError("db down"), {}]

    def load() -> dict[str, float]:
        item = loads.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    weights = TenantWeights(load, refresh_s=10, clock=lambda: now[0])
    assert weights.weight_of("a") == 2.0 and weights.weight_of("b") == 1.0
    now[0] = 10.0
    assert weights.weight_of("a") == 2.0  # the read failed: the last weights stand
    now[0] = 20.0
    assert weights.weight_of("a") == 1.0


LOW0 = TopicPartition("p.jobs.low", 0)


def start_what_may(buffer: PrefetchBuffer[str], counts: InFlightCounts, limit: int,
                   weight_of: Callable[[str], float] = lambda tenant: 1.0) -> list[str]:
    """Take records as the worker does: most urgent first, each tenant while it has room."""
    started = []
    while (rank := buffer.most_urgent_rank()) is not None:
        item = buffer.pop_most_urgent(counts.may_start(
            rank, limit, waiting=buffer.tenants_waiting(rank), weight_of=weight_of))
        if item is None:
            break
        started.append(item[1])
        counts.add(rank, tenant_of(item[1]))
    return started


def test_a_tenant_that_filled_the_worker_alone_yields_to_a_waiting_one_at_once() -> None:
    """A holds the whole bound (8 low); B's 3 records start now (B's share is 4 and free),
    past the bound; A starts nothing more while B waits, and once B has nothing waiting
    A is bound by the plain count again (8 - 11: nothing until 4 finish)."""
    counts = InFlightCounts([(2, "a")] * 8)
    buffer: PrefetchBuffer[str] = PrefetchBuffer(RANK, tenant_of=tenant_of)
    for i in range(4):
        buffer.add(LOW0, f"a{i}")
    for i in range(3):
        buffer.add(LOW0, f"b{i}")
    assert start_what_may(buffer, counts, 8) == ["b0", "b1", "b2"]
    assert len(buffer) == 4 and counts.by_rank[2] == 11
    assert counts.room_for_tenant(2, "a", 8, waiting={"a"}, weight_of=lambda t: 1.0) == -3


def test_a_waiting_tenant_is_held_to_its_share_and_a_lone_one_is_not() -> None:
    """Limit 8, B holds 5 low: alone it may start 3 more; with A waiting B's share is 4,
    so none, while A may start 4 (its share; B's one over it does not count)."""
    counts = InFlightCounts([(2, "b")] * 5)
    one = {"a": 1.0, "b": 1.0}.__getitem__
    assert counts.room_for_tenant(2, "b", 8, waiting={"b"}, weight_of=one) == 3
    assert counts.room_for_tenant(2, "b", 8, waiting={"a", "b"}, weight_of=one) == -1
    assert counts.room_for_tenant(2, "a", 8, waiting={"a", "b"}, weight_of=one) == 4
    # More urgent jobs in flight take their room from everyone.
    counts.add(1, "c")
    counts.add(1, "c")
    assert counts.room_for_tenant(2, "a", 8, waiting={"a", "b"}, weight_of=one) == 2


def test_shares_of_an_empty_worker_follow_the_weights() -> None:
    """Weights 3 and 1, both with plenty waiting, nothing in flight: 6 and 2 of 8 start,
    interleaved by the round robin, then nothing until jobs finish."""
    weights = {"a": 3.0, "b": 1.0}
    buffer: PrefetchBuffer[str] = PrefetchBuffer(RANK, tenant_of=tenant_of,
                                                 weight_of=weights.__getitem__)
    for i in range(10):
        buffer.add(LOW0, f"a{i}")
        buffer.add(LOW0, f"b{i}")
    started = start_what_may(buffer, InFlightCounts(), 8, weights.__getitem__)
    assert sorted(started) == ["a0", "a1", "a2", "a3", "a4", "a5", "b0", "b1"]


def test_a_lone_tenant_fills_the_whole_bound() -> None:
    buffer: PrefetchBuffer[str] = PrefetchBuffer(RANK, tenant_of=tenant_of)
    for i in range(12):
        buffer.add(LOW0, f"a{i}")
    assert start_what_may(buffer, InFlightCounts(), 8) == [f"a{i}" for i in range(8)]
