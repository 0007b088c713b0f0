"""The local supervisor restarts crashed workers with backoff, scales and drains."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from scheduler.supervisor import Supervisor

# Exits 0 on SIGTERM after writing a marker: a worker that drains.
_DRAINING_WORKER = """
import signal, sys, time, pathlib
out = pathlib.Path(sys.argv[1])
def drain(signum, frame):
    (out / f"drained-{__import__('os').getpid()}").write_text("ok")
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
(out / f"ready-{__import__('os').getpid()}").write_text("ok")
while True:
    time.sleep(0.05)
"""


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_crashed_worker_restarts_with_growing_backoff() -> None:
    """A worker that keeps exiting is restarted after 1x, 2x, 4x the minimum backoff."""
    sup = Supervisor([sys.executable, "-c", "raise SystemExit(3)"], num_workers=1,
                     min_backoff_s=0.1, max_backoff_s=0.4)
    sup.start()
    try:
        slot = sup.slots[0]
        backoffs: list[float] = []
        deadline = time.monotonic() + 15
        while len(backoffs) < 4 and time.monotonic() < deadline:
            sup.poll()
            if slot.exit_codes and (not backoffs or len(slot.exit_codes) > len(backoffs)):
                backoffs.append(slot.backoff_s)
            time.sleep(0.02)
        assert backoffs == [0.1, 0.2, 0.4, 0.4]
        assert set(slot.exit_codes) == {3}
        assert slot.num_restarts >= 3
    finally:
        sup.stop(timeout=5)


def test_scale_and_stop_drain_with_sigterm(tmp_path: Path) -> None:
    """scale_to starts new workers and drains the newest; stop drains the rest."""
    sup = Supervisor([sys.executable, "-c", _DRAINING_WORKER, str(tmp_path)], num_workers=1)
    sup.start()
    try:
        sup.scale_to(3)
        assert sup.num_running == 3
        pids = sup.pids
        _wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == 3)
        sup.scale_to(1)

        def drained_to_one() -> bool:
            sup.poll()
            return len(sup.slots) == 1

        _wait_for(drained_to_one)
        assert sup.slots[0].index == 0, "the oldest worker stays"
        assert len(list(tmp_path.glob("drained-*"))) == 2
    finally:
        sup.stop(timeout=10)
    assert sup.pids == []
    assert sorted(p.name for p in tmp_path.glob("drained-*")) == sorted(
        f"drained-{pid}" for pid in pids)


def test_stop_kills_a_worker_that_ignores_sigterm() -> None:
    """A worker that ignores SIGTERM is killed once the drain timeout passes."""
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" \
               "print('ready', flush=True)\ntime.sleep(60)"
    sup = Supervisor([sys.executable, "-c", stubborn], num_workers=1)
    sup.start()
    time.sleep(0.5)
    started = time.monotonic()
    sup.stop(timeout=1.0)
    assert time.monotonic() - started < 5
    assert sup.pids == []
