"""ServiceKeeper on real child processes (`sleep`, and one that cannot start)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.metrics import EMBEDDED_SERVICE_RESTARTS
from scheduler.embedded_services import ChildService
from scheduler.service_keeper import ServiceKeeper


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[ChildService]:
    """A started child that runs until killed; 'ready' as soon as it runs."""
    service = ChildService("sleeper", ["sleep", "600"], host="127.0.0.1", port=1,
                           log_path=tmp_path / "sleeper.log", ready_check=lambda: True)
    service.start()
    yield service
    service.stop()


def _kill(service: ChildService) -> None:
    assert service.pid is not None
    os.kill(service.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while service.is_running:
        assert time.monotonic() < deadline, "the child outlived SIGKILL"
        time.sleep(0.01)


def _poll_until(keeper: ServiceKeeper, num_restarts: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while keeper.num_restarts < num_restarts:
        assert time.monotonic() < deadline, f"only {keeper.num_restarts} restarts"
        keeper.poll()
        time.sleep(0.01)


def _restarts_counted(name: str) -> float:
    return EMBEDDED_SERVICE_RESTARTS.labels(service=name)._value.get()


def test_a_killed_service_is_restarted_after_its_backoff(sleeper: ChildService) -> None:
    """Dead → down at the next poll, started again only once the backoff has passed."""
    restored: list[int | None] = []
    keeper = ServiceKeeper(sleeper, on_restart=lambda: restored.append(sleeper.pid),
                           min_backoff_s=0.3)
    counted_before = _restarts_counted("sleeper")
    keeper.poll()
    assert not keeper.is_down and keeper.num_restarts == 0
    first_pid = sleeper.pid
    _kill(sleeper)
    died_at = time.monotonic()
    keeper.poll()
    assert keeper.is_down and not sleeper.is_running, "restarted before its backoff"
    assert sleeper.returncode == -signal.SIGKILL
    _poll_until(keeper, 1)
    assert time.monotonic() - died_at >= 0.3
    assert sleeper.is_running and sleeper.pid != first_pid and not keeper.is_down
    assert restored == [sleeper.pid], "on_restart runs once the service is back"
    assert _restarts_counted("sleeper") == counted_before + 1


def test_a_service_dying_again_soon_waits_twice_as_long(sleeper: ChildService) -> None:
    """A crash loop backs off exponentially, up to the maximum."""
    keeper = ServiceKeeper(sleeper, min_backoff_s=0.1, max_backoff_s=0.3,
                           healthy_after_s=60)
    backoffs = []
    for num_restarts in (1, 2, 3):
        _kill(sleeper)
        keeper.poll()
        backoffs.append(keeper.backoff_s)
        _poll_until(keeper, num_restarts)
    assert backoffs == [0.1, 0.2, 0.3]


def test_a_long_healthy_run_resets_the_backoff(sleeper: ChildService) -> None:
    """After running longer than healthy_after_s, a crash waits the minimum again."""
    keeper = ServiceKeeper(sleeper, min_backoff_s=0.1, max_backoff_s=5, healthy_after_s=0.2)
    keeper.backoff_s = 4.0  # as after a crash loop
    time.sleep(0.3)
    _kill(sleeper)
    keeper.poll()
    assert keeper.backoff_s == 0.1


def test_a_failed_restart_is_retried_with_a_longer_backoff(tmp_path: Path) -> None:
    """A service that exits during start-up is not counted as restarted; retries back off."""
    marker = tmp_path / "may-start"
    # Exits at once until the marker exists, then runs like a healthy service.
    service = ChildService("flaky", ["sh", "-c", f"test -e {marker} && exec sleep 600"],
                           host="127.0.0.1", port=1, log_path=tmp_path / "flaky.log",
                           ready_check=marker.exists)
    keeper = ServiceKeeper(service, min_backoff_s=0.05, max_backoff_s=1.0)
    try:
        deadline = time.monotonic() + 10
        while keeper.backoff_s < 0.2:
            assert time.monotonic() < deadline
            keeper.poll()
            time.sleep(0.01)
        assert keeper.is_down and keeper.num_restarts == 0
        marker.touch()
        _poll_until(keeper, 1)
        assert service.is_running and not keeper.is_down
    finally:
        service.stop()


def test_backoff_bounds_are_checked() -> None:
    """A minimum above the maximum is refused with both values named."""
    service = ChildService("x", ["true"], host="127.0.0.1", port=1, log_path=Path("/dev/null"))
    with pytest.raises(ValueError, match=r"min \(5\) <= max \(1\)"):
        ServiceKeeper(service, min_backoff_s=5, max_backoff_s=1)
