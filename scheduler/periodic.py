"""The scheduler's background loops: one step every interval on a daemon thread.

Every loop here is a pass that is safe to repeat (re-publish stale jobs, advance batches,
delete expired files, read lag and scale), so a failed step is logged and retried at the
next tick rather than ending the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Periodic:
    """step() every interval_s, measured from one start to the next, until stop is set.

    at_once=False waits an interval first: for loops whose first pass the caller has
    just run itself.
    """

    step: Callable[[], object]
    interval_s: float
    name: str
    at_once: bool = True

    def run(self, stop: threading.Event) -> None:
        """Loop on the calling thread until stop is set."""
        if not self.at_once and stop.wait(self.interval_s):
            return
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.step()
            except Exception:
                logger.exception("%s pass failed; next in %.1fs", self.name, self.interval_s)
            if stop.wait(max(0.0, self.interval_s - (time.monotonic() - started))):
                return

    def start(self, stop: threading.Event) -> threading.Thread:
        """run(stop) on a started daemon thread named after the loop."""
        thread = threading.Thread(target=self.run, args=(stop,), name=self.name, daemon=True)
        thread.start()
        return thread
