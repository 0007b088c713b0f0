"""The order the engine gives jobs of one priority: deadlines, with a default for none."""

from __future__ import annotations

from workers.inference.engine_loop import DEADLINE_HORIZON_S, engine_deadline

NOW = 1_000_000.0


def test_windows_run_earliest_first_and_jobs_without_one_before_far_windows() -> None:
    """Batches of 24 h, 2 h and 30 min windows and a job without a deadline, all arriving
    now: 30 min, the job, 2 h, 24 h."""
    keys = {name: engine_deadline(NOW + s, NOW) if s is not None else engine_deadline(None, NOW)
            for name, s in (("24h", 86_400.0), ("2h", 7_200.0), ("job", None),
                            ("30m", 1_800.0))}
    assert sorted(keys, key=keys.__getitem__) == ["30m", "job", "2h", "24h"]


def test_jobs_without_a_deadline_keep_their_arrival_order() -> None:
    first = engine_deadline(None, NOW)
    later = engine_deadline(None, NOW + 5)
    assert first < later and later - first == 5
    # One that has waited most of the hour goes before a new 30-minute deadline.
    waited = engine_deadline(None, NOW - DEADLINE_HORIZON_S + 600)
    assert waited < engine_deadline(NOW + 1_800, NOW)
