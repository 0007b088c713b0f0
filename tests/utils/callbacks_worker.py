"""The callbacks role (`python -m workers.callbacks`: Celery worker + beat) as a test subprocess.

It runs in a session of its own, so `kill()` can SIGKILL the whole process tree (worker,
embedded beat) at once, as a crashed machine would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

from core.settings import Settings
from tests.utils.settings_env import settings_env

REPO_ROOT = Path(__file__).resolve().parents[2]


class CallbacksWorker:
    """Start, kill and stop one callbacks process tree; its output goes to `log_path`."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> CallbacksWorker:
        """Launch the process tree (returns at once; the worker is up within seconds)."""
        assert self._process is None or self._process.poll() is not None, "already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "workers.callbacks"],
                cwd=REPO_ROOT,
                env=settings_env(self.settings),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        """The Celery worker's pid (its embedded beat is a child of it)."""
        assert self._process is not None, "not running"
        return self._process.pid

    def kill(self) -> None:
        """SIGKILL the whole tree: no warm shutdown, no acks, nothing flushed."""
        if self._process is None:
            return
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._process.wait(timeout=10)
        self._process = None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (Celery's warm shutdown), then SIGKILL what is left."""
        if self._process is None:
            return
        try:
            os.killpg(self._process.pid, signal.SIGTERM)
            self._process.wait(timeout=timeout)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def log(self) -> str:
        """What the process tree wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> CallbacksWorker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
