"""Run `batchinfer up` as a subprocess for tests: start, read its banner, stop, reap."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests.utils.budget import within_budget

ROOT = Path(__file__).resolve().parents[2]
API_KEY_PREFIX = "API key: "


@dataclass
class UpProcess:
    """A running `batchinfer up`, its printed lines and its API key."""

    process: subprocess.Popen[str]
    port: int
    log_path: Path
    lines: list[str] = field(default_factory=list)
    api_key: str = ""
    _queue: queue.Queue[str | None] = field(default_factory=queue.Queue)

    @property
    def url(self) -> str:
        """Base URL of the API."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """Authorization for the development tenant."""
        return {"Authorization": f"Bearer {self.api_key}"}

    def wait_for_line(self, prefix: str, timeout: float) -> str:
        """The first printed line starting with prefix; AssertionError after timeout."""
        for line in self.lines:
            if line.startswith(prefix):
                return line
        deadline = time.monotonic() + within_budget(timeout)
        while time.monotonic() < deadline:
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is None:
                break
            self.lines.append(item)
            if item.startswith(prefix):
                return item
        raise AssertionError(f"`batchinfer up` printed no {prefix!r} line; exit code "
                             f"{self.process.poll()}; stdout {self.lines}; log:\n"
                             f"{self.log_tail()}")

    def descendants(self) -> list[psutil.Process]:
        """Every live process below this one."""
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def running(self, name: str) -> list[psutil.Process]:
        """Live descendants running name: a binary (tansu, redis-server) or a `python -m`
        module. The warm start server (its command line lists the modules it imports) and
        a module's submodules do not count. Words, not arguments: a retitled process (Redis,
        a warm-started worker) shows its whole command line as one argument."""
        found = []
        for proc in self.descendants():
            try:
                words = " ".join(proc.cmdline()).split()
                if proc.status() != psutil.STATUS_ZOMBIE and any(
                        word == name or word.endswith("/" + name) for word in words):
                    found.append(proc)
            except psutil.NoSuchProcess:
                continue
        # A process forked by one of them (a subprocess between its fork and its exec)
        # carries the same command line for a moment: it is not another one.
        pids = {proc.pid for proc in found}
        own = []
        for proc in found:
            try:
                if proc.ppid() not in pids:
                    own.append(proc)
            except psutil.NoSuchProcess:
                continue
        return own

    def child(self, name: str) -> psutil.Process:
        """The one live descendant running name (see running)."""
        found = self.running(name)
        if len(found) != 1:
            raise AssertionError(f"expected one {name!r} process under `batchinfer up`, found "
                                 f"{[p.pid for p in found]}")
        return found[0]

    def kill_child(self, name: str) -> int:
        """SIGKILL the descendant running name (see child), as a crash would; its pid."""
        for _ in range(3):
            proc = self.child(name)
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                # Gone between the listing and the signal; look again.
                time.sleep(0.5)
                continue
            proc.wait(10)
            return proc.pid
        raise AssertionError(f"could not kill a {name!r} process under `batchinfer up`")

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM and wait; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill_tree(self) -> None:
        """SIGKILL this process and everything below it (cleanup after a failed test)."""
        for proc in self.descendants():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.kill()
        self.process.wait(10)

    def log_tail(self, num_chars: int = 6000) -> str:
        """The end of its stderr (logs)."""
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def client(self) -> httpx.Client:
        """An HTTP client for the API with the dev key."""
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60.0)


def start_up(data_dir: Path, port: int, *, num_workers: int, log_path: Path,
             timeout: float = 400.0, extra_env: dict[str, str] | None = None,
             max_workers: int | None = None, args: list[str] | None = None) -> UpProcess:
    """Start `batchinfer up` (extra_env on top, args after the others) and return once it
    printed its API key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    if "BATCHINFER_MODELS_DIR" in os.environ:
        env["BATCHINFER_MODELS_DIR"] = os.environ["BATCHINFER_MODELS_DIR"]
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra_env or {})
    argv = [sys.executable, "-m", "cli", "up", "--port", str(port), "--data-dir",
            str(data_dir), "--workers", str(num_workers)]
    if max_workers is not None:
        argv += ["--max-workers", str(max_workers)]
    argv += args or []
    with log_path.open("ab") as log:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                   env=env, cwd=ROOT)
    up = UpProcess(process=process, port=port, log_path=log_path)

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            up._queue.put(line.rstrip("\n"))
        up._queue.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        up.api_key = up.wait_for_line(API_KEY_PREFIX, timeout)[len(API_KEY_PREFIX):].strip()
    except BaseException:
        up.kill_tree()
        raise
    return up


def wait_for_status(client: httpx.Client, job_id: str, status: str, timeout: float) -> dict:
    """Long-poll a job until it reaches `status`; fail on another final status or timeout."""
    deadline = time.monotonic() + within_budget(timeout)
    job: dict = {}
    while time.monotonic() < deadline:
        response = client.get(f"/v1/jobs/{job_id}", params={"wait": 10})
        assert response.status_code == 200, response.text
        job = response.json()
        if job["status"] == status:
            return job
        assert job["status"] in ("queued", "running"), job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not {status} after {timeout}s: {job}")
