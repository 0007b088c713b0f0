"""Tenants' fair order in the waiting line within one priority (start-time fair queuing)."""

from __future__ import annotations

import pytest

from tests.unit.engine.scheduler_driver import Requests, SchedulerDriver, make_scheduler
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence


def admission_order(sched: Scheduler, num: int) -> list[Sequence]:
    """The next `num` sequences admitted, in order (max_num_seqs=1: one at a time)."""
    driver = SchedulerDriver(sched)
    order: list[Sequence] = []
    while len(order) < num:
        out, _ = driver.step()
        order.extend(seq for seq in out.seqs if seq not in order)
    return order


def test_a_later_tenant_is_admitted_within_its_share_behind_a_long_queue() -> None:
    """A has 200 queued; B's requests, coming after three of A's ran, alternate with A's
    from the very next admission instead of waiting behind all 197."""
    sched = make_scheduler(max_num_seqs=1, num_blocks=512)
    reqs = Requests()
    a = [reqs.add(sched, [3, 4], tenant="a", max_tokens=1) for _ in range(200)]
    assert admission_order(sched, 3) == a[:3]
    b = [reqs.add(sched, [5, 6], tenant="b", max_tokens=1) for _ in range(3)]
    assert admission_order(sched, 6) == [b[0], a[3], b[1], a[4], b[2], a[5]]
    assert admission_order(sched, 194) == a[6:]


def test_weights_share_admissions_in_proportion() -> None:
    """Weights 2 and 1, both queued at once with equal costs: two of A's per one of B's."""
    sched = make_scheduler(max_num_seqs=1, num_blocks=512)
    reqs = Requests()
    for _ in range(30):
        reqs.add(sched, [3, 4], tenant="a", weight=2.0, max_tokens=1)
    for _ in range(30):
        reqs.add(sched, [5, 6], tenant="b", max_tokens=1)
    first = [str(seq.tenant) for seq in admission_order(sched, 30)]
    assert abs(first.count("a") - 20) <= 1
    # Interleaved all along, not A's share first and B's after.
    assert "bb" not in "".join(first) and "aaaa" not in "".join(first)


def test_cost_counts_tokens_not_requests() -> None:
    """A's requests cost 4x B's (prompt + max_tokens): B gets ~4 admissions per one of A's."""
    sched = make_scheduler(max_num_seqs=1, num_blocks=512)
    reqs = Requests()
    for _ in range(10):
        reqs.add(sched, [3] * 7, tenant="a", max_tokens=1)  # 8 tokens
    for _ in range(40):
        reqs.add(sched, [5], tenant="b", max_tokens=1)  # 2 tokens
    first = [seq.tenant for seq in admission_order(sched, 25)]
    assert first.count("a") in (5, 6)


@pytest.mark.parametrize("tenant", [None, "only"])
def test_a_lone_tenant_runs_in_arrival_order(tenant: str | None) -> None:
    """One tenant (or none at all): the order is arrival order whatever the costs, as
    before tenants; deadlines order first as ever."""
    sched = make_scheduler(max_num_seqs=1, num_blocks=512)
    reqs = Requests()
    seqs = [reqs.add(sched, [3] * (1 + i % 5), tenant=tenant, max_tokens=1 + i % 3)
            for i in range(20)]
    assert admission_order(sched, 20) == seqs


def test_deadlines_order_before_the_fair_share() -> None:
    """Behind A's long queue, A's own request with a deadline goes first, then B's (fair
    share), and a more urgent priority before all of them."""
    sched = make_scheduler(max_num_seqs=1, num_blocks=512)
    reqs = Requests()
    a = [reqs.add(sched, [3, 4], tenant="a", max_tokens=1) for _ in range(20)]
    b = reqs.add(sched, [5, 6], tenant="b", max_tokens=1)
    a_due = reqs.add(sched, [7, 8], tenant="a", deadline=1000.0, max_tokens=1)
    b_due_later = reqs.add(sched, [7, 9], tenant="b", deadline=2000.0, max_tokens=1)
    urgent = reqs.add(sched, [7, 10], tenant="a", priority=-1, max_tokens=1)
    assert admission_order(sched, 5) == [urgent, a_due, b_due_later, a[0], b]


def test_a_returning_tenant_saves_no_credit() -> None:
    """B ran alone for a while, then went quiet; A's queue since then is not behind B's
    next burst: B rejoins at the current virtual time, alternating with A, not ahead."""
    sched = make_scheduler(max_num_seqs=1, num_blocks=512)
    reqs = Requests()
    for _ in range(5):
        reqs.add(sched, [3, 4], tenant="b", max_tokens=1)
    admission_order(sched, 5)
    a = [reqs.add(sched, [3, 4], tenant="a", max_tokens=1) for _ in range(20)]
    assert admission_order(sched, 4) == a[:4]
    b = [reqs.add(sched, [5, 6], tenant="b", max_tokens=1) for _ in range(4)]
    assert admission_order(sched, 4) == [b[0], a[4], b[1], a[5]]

