"""Run the service's roles for integration tests: the API on a thread, workers as processes."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from api.http_limits import bounded_http_config
from core.settings import Settings
from scheduler.embedded_services import free_port
from tests.utils.child_process import ChildProcess


@contextmanager
def running_api(settings: Settings) -> Iterator[str]:
    """Serve create_app(settings) on a free port in this process; yields its base URL."""
    from api.app import create_app

    port = free_port()
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="on",
                            **bounded_http_config(settings.api_max_head_bytes,
                                                settings.api_head_timeout_s))
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


class WorkerProcess(ChildProcess):
    """`python -m workers.inference` as a child process on the given settings."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        super().__init__(["workers.inference"], settings, log_path,
                         warm=settings.worker_warm_start)

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL, no drain (a crash)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
