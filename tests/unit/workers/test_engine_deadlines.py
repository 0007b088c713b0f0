"""The order the engine gives jobs of one priority: near deadlines, then the tenants' share."""

from __future__ import annotations

from workers.inference.engine_loop import DEADLINE_HORIZON_S, engine_deadline

NOW = 1_000_000.0


def test_near_deadlines_order_and_far_windows_share_with_jobs_without_one() -> None:
    """Batches of 24 h, 2 h and 30 min windows and a job without a deadline, all arriving
    now: only the 30 min one orders by its deadline; the others are left to the tenants'
    fair share (no deadline), so no far-off batch runs ahead of another tenant's jobs."""
    assert engine_deadline(NOW + 1_800, NOW) == NOW + 1_800
    assert engine_deadline(NOW + DEADLINE_HORIZON_S, NOW) == NOW + DEADLINE_HORIZON_S
    for far in (7_200.0, 86_400.0):
        assert engine_deadline(NOW + far, NOW) is None
    assert engine_deadline(None, NOW) is None


def test_a_passed_deadline_still_orders_first() -> None:
    assert engine_deadline(NOW - 5, NOW) == NOW - 5
