"""Run the service's roles for integration tests: the API on a thread, workers as processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from core.settings import Settings
from scheduler.embedded_services import die_with_parent, free_port
from tests.utils.settings_env import settings_env

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def running_api(settings: Settings) -> Iterator[str]:
    """Serve create_app(settings) on a free port in this process; yields its base URL."""
    from api.app import create_app

    port = free_port()
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"test API did not start on port {port}")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


class WorkerProcess:
    """`python -m workers.inference` as a child process on the given settings."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.log_path = log_path
        env = settings_env(settings)
        env["PYTHONUNBUFFERED"] = "1"
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "workers.inference"], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                preexec_fn=die_with_parent)

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.process.pid

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (drain), then SIGKILL after timeout; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL, no drain (a crash)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def log_tail(self, num_chars: int = 6000) -> str:
        """The end of its log."""
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""
