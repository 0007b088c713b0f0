"""A local supervisor of worker processes.

Responsible for:
- starting N copies of a worker command as child processes (`python -m` ones forked
  from the warm server with `warm_start`, see scheduler/warm_start);
- restarting one that exits on its own, after an exponential backoff that resets once a
  worker has stayed up for a while (a crash loop does not spin the CPU);
- changing the count (`scale_to`): new workers start at once, surplus ones are drained
  with SIGTERM (newest first) — the hook the autoscaler drives;
- stopping all: SIGTERM so each drains (finishes or releases in-flight jobs and commits),
  then SIGKILL whatever outlives the drain timeout;
- with `liveness_dir` and `liveness_timeout_s`: liveness, not only exit. Each child gets its
  own liveness file (`BATCHINFER_WORKER_LIVENESS_FILE`), which it stamps while it works
  (`core.liveness_file`); one whose file has aged past the timeout (frozen by SIGSTOP, a
  hung loop) is SIGKILLed, and then restarted as any worker that exits. The clock starts
  at the child's first stamp: loading a model is not a stall.

Children run in their own session (a terminal's Ctrl-C reaches only the parent, which
stops them in order) and get SIGTERM if the parent dies. Call start/poll/scale_to from the
main thread: the parent-death signal follows the thread that spawned the child.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from core.liveness_file import age_s as liveness_age_s
from scheduler.warm_start import Child, start_command, start_module

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerSlot:
    """One supervised worker: its process (None while waiting to restart) and history."""

    index: int
    process: Child | None = None
    started_at: float = 0.0
    num_restarts: int = 0
    next_start_at: float = 0.0
    backoff_s: float = 0.0
    draining: bool = False
    exit_codes: list[int] = field(default_factory=list)

    @property
    def is_alive(self) -> bool:
        """True while the process runs."""
        return self.process is not None and self.process.poll() is None


class Supervisor:
    """Keeps `num_workers` copies of `argv` running."""

    def __init__(
        self,
        argv: list[str],
        *,
        num_workers: int,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        name: str = "worker",
        min_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        healthy_after_s: float = 60.0,
        drain_timeout_s: float = 60.0,
        liveness_dir: Path | None = None,
        liveness_timeout_s: float | None = None,
        warm_start: bool = False,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if (liveness_dir is None) != (liveness_timeout_s is None):
            raise ValueError("liveness_dir and liveness_timeout_s go together")
        self.liveness_dir = liveness_dir
        self.liveness_timeout_s = liveness_timeout_s
        self.num_stall_kills = 0
        self.argv = argv
        # `python -m MODULE` children fork from a server that has imported the engine
        # (scheduler.warm_start): a restart or a scale-up skips seconds of imports.
        self.warm_start = warm_start
        self.env = env
        self.log_dir = log_dir
        self.name = name
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.drain_timeout_s = drain_timeout_s
        self.num_desired = num_workers
        self.slots: list[WorkerSlot] = []
        self._hurried = False  # asked to stop at once: a stop begun after it hurries too
        self._next_index = 0
        self._lock = threading.Lock()

    @property
    def num_running(self) -> int:
        """Workers alive and not draining."""
        return sum(1 for s in self.slots if s.is_alive and not s.draining)

    @property
    def pids(self) -> list[int]:
        """Process ids of every live child, draining ones included."""
        return [s.process.pid for s in self.slots if s.process is not None and s.is_alive]

    def start(self) -> None:
        """Start the desired number of workers."""
        with self._lock:
            self._reconcile_count()

    def scale_to(self, num_workers: int) -> None:
        """Start or drain workers until num_workers run."""
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        with self._lock:
            if num_workers != self.num_desired:
                logger.info("scaling %ss %d → %d", self.name, self.num_desired, num_workers)
            self.num_desired = num_workers
            self._reconcile_count()

    def poll(self) -> None:
        """Reap exited workers, schedule restarts with backoff, start those now due."""
        with self._lock:
            self._kill_stalled()
            now = time.monotonic()
            for slot in list(self.slots):
                if slot.process is None or slot.is_alive:
                    continue
                code = slot.process.poll()
                assert code is not None  # is_alive saw it end
                slot.exit_codes.append(code)
                slot.process = None
                if slot.draining:
                    logger.info("%s-%d drained (exit code %d)", self.name, slot.index, code)
                    self.slots.remove(slot)
                    continue
                uptime = now - slot.started_at
                if uptime >= self.healthy_after_s:
                    slot.backoff_s = self.min_backoff_s
                else:
                    slot.backoff_s = min(self.max_backoff_s,
                                         max(self.min_backoff_s, slot.backoff_s * 2))
                slot.next_start_at = now + slot.backoff_s
                logger.warning("%s-%d exited with code %d after %.1fs; restarting in %.1fs",
                               self.name, slot.index, code, uptime, slot.backoff_s)
            for slot in self.slots:
                if slot.process is None and not slot.draining and now >= slot.next_start_at:
                    slot.num_restarts += 1
                    self._spawn(slot)
            self._reconcile_count()

    def run(self, stop: threading.Event, interval_s: float = 0.5) -> None:
        """Poll until stop is set (then the caller calls stop())."""
        while not stop.wait(interval_s):
            self.poll()

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM every worker, wait for them to drain, SIGKILL stragglers."""
        deadline = time.monotonic() + (self.drain_timeout_s if timeout is None else timeout)
        with self._lock:
            self.num_desired = 0
            live = [s for s in self.slots if s.is_alive]
            for slot in live:
                slot.draining = True
                self._signal(slot, signal.SIGTERM)
                if self._hurried:  # the second stop came before this first one
                    self._signal(slot, signal.SIGINT)
            for slot in live:
                assert slot.process is not None
                try:
                    slot.process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s-%d did not drain in time; killing it", self.name,
                                   slot.index)
                    slot.process.kill()
                    slot.process.wait()
            self.slots.clear()

    def hurry(self) -> None:
        """Signal the draining workers again: each hands back its unfinished jobs now.

        SIGINT, which a worker takes as it takes SIGTERM, and not a second SIGTERM: a
        signal sent while the same one still waits for the worker's handler merges with it.
        `up` asks this on a second Ctrl-C, which can come before its first has reached
        stop(): a test's came that soon, found no worker draining yet, and its 126 jobs were
        drained in full. So it is remembered, and stop() hurries what it stops. Safe from a
        signal handler that interrupted stop() (no lock taken)."""
        self._hurried = True
        for slot in list(self.slots):
            if slot.draining:
                self._signal(slot, signal.SIGINT)

    def _reconcile_count(self) -> None:
        active = [s for s in self.slots if not s.draining]
        for _ in range(self.num_desired - len(active)):
            slot = WorkerSlot(index=self._next_index, backoff_s=0.0)
            self._next_index += 1
            self.slots.append(slot)
            self._spawn(slot)
        # Drain the newest surplus first: older workers hold warm prefix caches.
        surplus = len(active) - self.num_desired
        for slot in sorted(active, key=lambda s: s.index, reverse=True)[:max(0, surplus)]:
            slot.draining = True
            if slot.is_alive:
                self._signal(slot, signal.SIGTERM)
            else:
                self.slots.remove(slot)

    def liveness_file(self, slot: WorkerSlot) -> Path | None:
        """The file slot's child stamps while it works (None without liveness)."""
        if self.liveness_dir is None:
            return None
        return self.liveness_dir / f"{self.name}-{slot.index}.alive"

    def _kill_stalled(self) -> None:
        """SIGKILL every child whose liveness file has aged past the timeout."""
        if self.liveness_timeout_s is None:
            return
        for slot in self.slots:
            path = self.liveness_file(slot)
            if path is None or not slot.is_alive:
                continue
            age = liveness_age_s(path)
            if age is None or age <= self.liveness_timeout_s:
                continue
            assert slot.process is not None
            logger.error("%s-%d (pid %d) gave no sign of life for %.0fs (limit %.0fs): "
                         "frozen or hung; killing it", self.name, slot.index,
                         slot.process.pid, age, self.liveness_timeout_s)
            slot.process.kill()  # SIGKILL ends a stopped process too
            path.unlink(missing_ok=True)
            self.num_stall_kills += 1

    def _spawn(self, slot: WorkerSlot) -> None:
        env = self.env
        path = self.liveness_file(slot)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # the previous child's: its age is not this one's
            env = {**(os.environ if env is None else env),
                   "BATCHINFER_WORKER_LIVENESS_FILE": str(path)}
        log_path = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{self.name}-{slot.index}.log"
        slot.process = self._start_child(env, log_path)
        slot.started_at = time.monotonic()
        logger.info("started %s-%d (pid %d)", self.name, slot.index, slot.process.pid)

    def _start_child(self, env: dict[str, str] | None, log_path: Path | None) -> Child:
        module_args = self.argv[2:] if self.argv[1:2] == ["-m"] else None
        if self.warm_start and module_args:
            return start_module(module_args[0], module_args[1:], env=env, log_path=log_path)
        return start_command(self.argv, env=env, log_path=log_path)

    def _signal(self, slot: WorkerSlot, signum: int) -> None:
        if slot.process is not None and slot.process.poll() is None:
            slot.process.send_signal(signum)
