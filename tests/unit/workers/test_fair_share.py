"""Fair share at the worker's intake: deficit round robin over tenants within a priority,
by weight; a lone tenant takes every start; the tenant read from a record's value."""

from __future__ import annotations

from dataclasses import dataclass

from kafka import TopicPartition

from core.messages import JobMessage
from workers.inference.prefetch import PrefetchBuffer
from workers.inference.tenant_share import TenantWeights, record_tenant

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
