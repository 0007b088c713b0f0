"""How much work a busy worker holds, at the pace its jobs finish (workers.inference.fetch_wait)."""

from __future__ import annotations

import math

from workers.inference.fetch_wait import WorkPace, num_finishable


def _pace_after(*loops: tuple[float, int, int]) -> WorkPace:
    """A 2-second WorkPace fed worker loops given as (when, jobs finished, jobs in flight)."""
    pace = WorkPace(window_s=2.0)
    for now, num_finished, num_inflight in loops:
        pace.on_loop(num_finished=num_finished, num_inflight=num_inflight, now=now)
    return pace


def test_the_pace_counts_only_after_a_whole_window_of_being_busy() -> None:
    pace = _pace_after((10.0, 0, 100), (11.0, 50, 100))
    # One second of 50 finished would read as 25 a second over the window: too slow.
    assert pace.seconds_of_work(200, now=11.9) == 0.0
    pace.on_loop(num_finished=50, num_inflight=100, now=12.0)
    # 100 finished in the last two seconds: 200 jobs last four.
    assert pace.seconds_of_work(200, now=12.0) == 4.0


def test_finishes_older_than_the_window_stop_counting() -> None:
    pace = _pace_after((0.0, 0, 10), (1.0, 90, 10), (2.5, 10, 10))
    assert pace.seconds_of_work(10, now=2.5) == 0.2
    pace.on_loop(num_finished=0, num_inflight=10, now=3.2)  # the 90 are out of the window
    assert math.isclose(pace.seconds_of_work(10, now=3.2), 2.0)
    # Nothing finished in a whole window with jobs in flight: long generations.
    pace.on_loop(num_finished=0, num_inflight=10, now=5.0)
    assert pace.seconds_of_work(10, now=5.0) == math.inf


def test_an_idle_moment_starts_the_busy_window_again() -> None:
    pace = _pace_after((0.0, 0, 5), (3.0, 5, 0), (3.1, 0, 5))
    assert pace.seconds_of_work(5, now=4.0) == 0.0
    pace.on_loop(num_finished=2, num_inflight=5, now=4.5)
    # Busy for a whole window again; the 5 finished at 3.0 are out of it by 5.2.
    assert pace.seconds_of_work(5, now=5.2) == 5.0


def test_a_drain_keeps_only_the_jobs_its_time_allows() -> None:
    """Unknown pace: keep all. No job finished in a whole busy window: keep none (the drain
    hands them back at once). Otherwise as many as the pace finishes in the time left."""
    assert num_finishable(0.0, num_jobs=300, seconds_left=30.0) == 300
    assert num_finishable(math.inf, num_jobs=300, seconds_left=30.0) == 0
    assert num_finishable(60.0, num_jobs=300, seconds_left=30.0) == 150
    assert num_finishable(10.0, num_jobs=300, seconds_left=30.0) == 300
    assert num_finishable(10.0, num_jobs=3, seconds_left=0.0) == 0
    pace = WorkPace(window_s=10.0)
    pace.on_loop(num_finished=0, num_inflight=300, now=0.0)
    pace.on_loop(num_finished=0, num_inflight=300, now=10.0)
    assert num_finishable(pace.seconds_of_work(300, now=10.0), num_jobs=300,
                          seconds_left=30.0) == 0
