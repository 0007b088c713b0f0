"""A `python -m MODULE ...` child process for tests: started on settings, logging to a file."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from core.settings import Settings
from scheduler.warm_start import start_module
from tests.utils.settings_env import settings_env

ROOT = Path(__file__).resolve().parents[2]


class ChildProcess:
    """`python -m ARGV...` on the given settings; dies with the test process. `warm`
    forks it from the warm server, as `up` starts its workers (scheduler/warm_start)."""

    def __init__(self, argv: list[str], settings: Settings, log_path: Path, *,
                 warm: bool = False) -> None:
        self.log_path = log_path
        env = settings_env(settings)
        env["PYTHONUNBUFFERED"] = "1"
        self.process = start_module(argv[0], argv[1:], env=env, log_path=log_path, cwd=ROOT,
                                    new_session=False, warm=warm)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (a worker drains), then SIGKILL after `timeout`; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_tail(self, num_chars: int = 6000) -> str:
        """The end of its log."""
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""
