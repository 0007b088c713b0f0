"""Run a `batchinfer <role>` as a child process for tests, and watch its memory."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from core.settings import Settings
from scheduler.embedded_services import die_with_parent
from tests.utils.settings_env import settings_env

ROOT = Path(__file__).resolve().parents[2]


class CliProcess:
    """`python -m core.cli ARGS...` on the given settings, logging to a file."""

    def __init__(self, args: list[str], settings: Settings, log_path: Path) -> None:
        self.log_path = log_path
        env = settings_env(settings)
        env["PYTHONUNBUFFERED"] = "1"
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "core.cli", *args], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                preexec_fn=die_with_parent)

    @property
    def rss_bytes(self) -> int:
        """Resident set size of the process now."""
        return int(psutil.Process(self.process.pid).memory_info().rss)

    def wait_http(self, url: str, timeout: float = 120.0) -> None:
        """Wait until `url` answers 200; fail with the log if the process dies first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.log_path.name} exited:\n{self.log_tail()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{url} did not answer in {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; the exit code."""
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
