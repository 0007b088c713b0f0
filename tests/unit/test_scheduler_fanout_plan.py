"""The fan-out's shared window: one room per model and priority, filled by tenant share
and then by deadline (scheduler.fanout_plan.plan_room)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.fanout_plan import plan_room


@dataclass(frozen=True, slots=True)
class Batch:
    batch_id: str
    tenant_id: str
    num_left: int


def test_the_nearest_deadline_fills_the_room_first_and_the_far_one_gets_the_rest() -> None:
    # Deadline order: "30m", "2h", "24h" (the reverse of their submission).
    waiting = [Batch("30m", "t", 400), Batch("2h", "t", 400), Batch("24h", "t", 400)]
    plan = plan_room(1000, waiting, {"t": 300}, {})
    assert plan == {"30m": 400, "2h": 300}
    assert list(plan) == ["30m", "2h"]  # the order the pass enqueues them in


def test_a_far_deadline_progresses_when_nothing_nearer_waits() -> None:
    waiting = [Batch("30m", "t", 100), Batch("7d", "t", 5000)]
    assert plan_room(2000, waiting, {"t": 0}, {}) == {"30m": 100, "7d": 1900}


def test_no_room_while_the_pair_has_a_window_queued() -> None:
    waiting = [Batch("30m", "t", 400)]
    assert plan_room(2000, waiting, {"t": 1500, "u": 500}, {}) == {}
    assert plan_room(2000, waiting, {"t": 1999}, {}) == {"30m": 1}


def test_no_window_lets_every_batch_enqueue_all_its_lines() -> None:
    waiting = [Batch("a", "t", 400), Batch("b", "u", 7), Batch("c", "t", 0)]
    assert plan_room(0, waiting, {"t": 10_000}, {}) == {"a": 400, "b": 7}


def test_each_tenant_gets_its_weighted_share_before_deadline_order() -> None:
    # Tenant t's batch is due first, but u (weight 3 to t's 1) is owed 3/4 of the window.
    waiting = [Batch("t-soon", "t", 5000), Batch("u-late", "u", 5000)]
    plan = plan_room(1000, waiting, {}, {"u": 3.0})
    assert plan == {"t-soon": 250, "u-late": 750}
    assert list(plan) == ["t-soon", "u-late"]


def test_room_a_tenant_cannot_use_goes_in_deadline_order() -> None:
    # u has 50 lines left of its 500 share: the other 450 go to t's batches, nearest first.
    waiting = [Batch("t-soon", "t", 600), Batch("u-late", "u", 50), Batch("t-late", "t", 900)]
    plan = plan_room(1000, waiting, {}, {})
    assert plan == {"t-soon": 600, "u-late": 50, "t-late": 350}


def test_a_tenant_share_counts_its_queued_lines() -> None:
    # Window 1000, shares 500 each: t has 400 queued, so 100 more; u none, so 500.
    waiting = [Batch("t1", "t", 5000), Batch("u1", "u", 5000)]
    assert plan_room(1000, waiting, {"t": 400}, {}) == {"t1": 100, "u1": 500}


def test_a_tenant_with_lines_queued_but_none_left_still_holds_its_share() -> None:
    # v has fanned out all its lines and 300 are queued: t and u split the rest by share.
    waiting = [Batch("t1", "t", 5000), Batch("u1", "u", 5000)]
    plan = plan_room(900, waiting, {"v": 300}, {})
    assert plan == {"t1": 300, "u1": 300}


def test_shares_beyond_the_room_are_scaled_down_in_proportion() -> None:
    # t is over its share (800 queued of 500): the room is 200, and u and v are owed 333
    # each; they get 100 each rather than the first in line taking it all.
    waiting = [Batch("u1", "u", 5000), Batch("v1", "v", 5000), Batch("t1", "t", 5000)]
    plan = plan_room(1000, waiting, {"t": 800}, {})
    assert plan == {"u1": 100, "v1": 100}
    assert sum(plan.values()) == 200


def test_a_lone_tenant_gets_the_whole_room_in_deadline_order() -> None:
    waiting = [Batch("a", "t", 300), Batch("b", "t", 300)]
    assert plan_room(500, waiting, {"t": 100}, {"t": 0.1}) == {"a": 300, "b": 100}
