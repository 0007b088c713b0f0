"""Run a `batchinfer <role>` as a child process for tests, and watch its memory."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psutil

from core.settings import Settings
from tests.utils.budget import within_budget
from tests.utils.child_process import ChildProcess


class CliProcess(ChildProcess):
    """`python -m cli ARGS...` on the given settings, logging to a file.

    Forked from the warm server as `up`'s workers are: a cold start imports torch and
    transformers (to count prompt tokens) for 4-6 s of CPU, and the suite starts ~40 of
    these beside everything else on a 2-core machine. `warm=False` keeps a fresh
    interpreter where the cold start itself is under test."""

    def __init__(self, args: list[str], settings: Settings, log_path: Path, *,
                 warm: bool = True) -> None:
        super().__init__(["cli", *args], settings, log_path, warm=warm)

    @property
    def rss_bytes(self) -> int:
        """Resident set size of the process now."""
        return int(psutil.Process(self.process.pid).memory_info().rss)

    def wait_http(self, url: str, timeout: float = 120.0) -> None:
        """Wait until `url` answers 200; fail with the log if the process dies first."""
        deadline = time.monotonic() + within_budget(timeout)
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
