"""The scheduler's background loops: one step every interval on a daemon thread.

Every loop here is a pass that is safe to repeat (re-publish stale jobs, advance batches,
delete expired files, read lag and scale), so a failed step is logged and retried at the
next tick rather than ending the thread. A loop given a `Wakeup` also passes early when
someone knows there is work: the interval is the longest it waits, not the only pace.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


# Longest a waiting loop goes without looking at its stop event.
STOP_CHECK_S = 0.5


class Wakeup:
    """Brings a loop's next pass forward: at once (`set`) or within some seconds (`soon`).

    A wakeup that comes while a pass runs is kept, so the next wait ends at once: work
    announced during a pass that had already looked is never left for a whole interval.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._due = math.inf  # monotonic time of the earliest requested pass

    def set(self) -> None:
        """Pass again as soon as the current pass (if any) ends."""
        self.soon(0.0)

    def soon(self, seconds: float) -> None:
        """Pass again within `seconds`, or sooner if already asked for."""
        with self._changed:
            self._due = min(self._due, time.monotonic() + max(seconds, 0.0))
            self._changed.notify_all()

    def wait(self, stop: threading.Event, timeout: float) -> bool:
        """Wait until `timeout` passes, a wakeup is due or stop is set; True on stop."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._changed:
            while not stop.is_set():
                remaining = min(deadline, self._due) - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(min(remaining, STOP_CHECK_S))
            self._due = math.inf
        return stop.is_set()


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
    wakeup: Wakeup | None = None

    def run(self, stop: threading.Event) -> None:
        """Loop on the calling thread until stop is set."""
        if not self.at_once and self._wait(stop, self.interval_s):
            return
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.step()
            except Exception:
                logger.exception("%s pass failed; next in %.1fs", self.name, self.interval_s)
            if self._wait(stop, self.interval_s - (time.monotonic() - started)):
                return

    def _wait(self, stop: threading.Event, timeout: float) -> bool:
        """Until the next pass is due; True once stop is set."""
        if self.wakeup is None:
            return stop.wait(max(0.0, timeout))
        return self.wakeup.wait(stop, timeout)

    def start(self, stop: threading.Event) -> threading.Thread:
        """run(stop) on a started daemon thread named after the loop."""
        thread = threading.Thread(target=self.run, args=(stop,), name=self.name, daemon=True)
        thread.start()
        return thread
