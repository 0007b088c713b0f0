"""Which batches a worker announces as drained after storing what finished."""

from __future__ import annotations

from workers.inference.batch_drain import MAX_REMEMBERED, MIN_WAKE_GAP_S, BatchDrains


def test_a_batch_is_announced_once_none_of_its_jobs_is_held() -> None:
    drains = BatchDrains()
    # b still has a job in flight; jobs without a batch are never announced.
    assert drains.drained(["a", "b", None, "a"], ["b", None], now=10.0) == ["a"]
    assert drains.drained(["b"], [], now=10.0) == ["b"]


def test_one_batch_is_announced_at_most_once_per_gap() -> None:
    drains = BatchDrains()
    assert drains.drained(["a"], [], now=10.0) == ["a"]
    assert drains.drained(["a"], [], now=10.0 + MIN_WAKE_GAP_S / 2) == []
    assert drains.drained(["a"], [], now=10.0 + 1.5 * MIN_WAKE_GAP_S) == ["a"]


def test_what_it_remembers_stays_bounded() -> None:
    drains = BatchDrains()
    for i in range(MAX_REMEMBERED + 10):
        assert drains.drained([f"batch-{i}"], [], now=float(i)) == [f"batch-{i}"]
    assert len(drains._woken_at) <= MAX_REMEMBERED
