"""The local supervisor restarts crashed workers with backoff, scales and drains."""

from __future__ import annotations

import os
import signal
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


def test_stop_kills_a_worker_that_ignores_sigterm(tmp_path: Path) -> None:
    """A worker that ignores SIGTERM is killed once the drain timeout passes."""
    stubborn = ("import signal, sys, time, pathlib\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "pathlib.Path(sys.argv[1]).write_text('ready')\ntime.sleep(60)")
    ready = tmp_path / "ready"
    sup = Supervisor([sys.executable, "-c", stubborn, str(ready)], num_workers=1)
    sup.start()
    process = sup.slots[0].process
    assert process is not None
    _wait_for(ready.exists, timeout=60)  # SIGTERM is ignored from now on
    started = time.monotonic()
    sup.stop(timeout=1.0)
    assert time.monotonic() - started >= 1.0, "it was waited for before the kill"
    assert process.returncode == -signal.SIGKILL, "SIGTERM alone did not end it"
    assert sup.pids == []


# Stamps its liveness file (named by the supervisor) every 50 ms, after a ready marker.
_STAMPING_WORKER = """
import os, pathlib, sys, time
path = pathlib.Path(os.environ["BATCHINFER_WORKER_LIVENESS_FILE"])
(pathlib.Path(sys.argv[1]) / f"ready-{os.getpid()}").write_text("ok")
while True:
    path.touch()
    os.utime(path)
    time.sleep(0.05)
"""


def test_a_frozen_worker_is_killed_and_replaced(tmp_path: Path) -> None:
    """A worker whose liveness file ages past the timeout (frozen by SIGSTOP) is SIGKILLed
    and restarted like one that exited; the new one gets a fresh file."""
    sup = Supervisor([sys.executable, "-c", _STAMPING_WORKER, str(tmp_path)], num_workers=1,
                     min_backoff_s=0.1, liveness_dir=tmp_path / "run", liveness_timeout_s=1.0)
    sup.start()
    try:
        slot = sup.slots[0]
        frozen = slot.process
        assert frozen is not None
        path = sup.liveness_file(slot)
        assert path is not None
        _wait_for(path.exists, timeout=60)
        os.kill(frozen.pid, signal.SIGSTOP)

        def replaced() -> bool:
            sup.poll()
            return slot.process is not None and slot.process.pid != frozen.pid

        _wait_for(replaced, timeout=60)
        assert frozen.returncode == -signal.SIGKILL
        assert slot.exit_codes == [-signal.SIGKILL] and sup.num_stall_kills == 1
        successor = slot.process
        assert successor is not None
        _wait_for(lambda: (tmp_path / f"ready-{successor.pid}").exists(), timeout=60)
        _wait_for(path.exists, timeout=60)  # the new worker stamps its own
    finally:
        sup.stop(timeout=5)


def test_a_worker_is_not_judged_before_its_first_stamp(tmp_path: Path) -> None:
    """Until a worker first stamps its file (loading a model), no age is held against it."""
    silent = ("import os, pathlib, sys, time\n"
              "pathlib.Path(sys.argv[1]).write_text('ready')\ntime.sleep(60)")
    ready = tmp_path / "ready"
    sup = Supervisor([sys.executable, "-c", silent, str(ready)], num_workers=1,
                     liveness_dir=tmp_path / "run", liveness_timeout_s=0.2)
    sup.start()
    try:
        slot = sup.slots[0]
        _wait_for(ready.exists, timeout=60)
        _wait_for(lambda: time.monotonic() - slot.started_at > 0.5)
        sup.poll()
        assert slot.is_alive and sup.num_stall_kills == 0
    finally:
        sup.stop(timeout=5)


# Records each stop signal; a second one (either) makes it hand back and exit, as a worker.
_HURRIED_WORKER = """
import signal, sys, time, pathlib
out = pathlib.Path(sys.argv[1])
seen = []
def stop(signum, frame):
    seen.append(signal.Signals(signum).name)
    if len(seen) == 2:
        (out / "signals").write_text(" ".join(seen))
        sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
(out / "ready").write_text("ok")
while True:
    time.sleep(0.05)
"""


def test_a_hurry_asked_before_the_stop_reaches_the_workers_it_stops(tmp_path: Path) -> None:
    """`up`'s second Ctrl-C can come before its first has reached stop(): stop() must then
    hurry the workers it stops, with a signal of its own (SIGINT beside the SIGTERM; both
    pending at once, Python runs SIGINT's handler first), or the drain runs to its end:
    here 20 s, then a kill."""
    sup = Supervisor([sys.executable, "-c", _HURRIED_WORKER, str(tmp_path)], num_workers=1,
                     drain_timeout_s=20)
    sup.start()
    _wait_for(lambda: (tmp_path / "ready").exists())
    sup.hurry()  # no worker is draining yet: nothing to signal now
    started = time.monotonic()
    sup.stop()
    assert time.monotonic() - started < 15
    assert sorted((tmp_path / "signals").read_text().split()) == ["SIGINT", "SIGTERM"]
