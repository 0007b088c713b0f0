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

logger = logging.getLogger(__name__)


def run_every(
    step: Callable[[], object],
    stop: threading.Event,
    *,
    interval_s: float,
    name: str,
    at_once: bool = True,
) -> None:
    """Call step() every interval_s (from one start to the next) until stop is set.

    at_once=False waits an interval first: for loops whose first pass the caller has
    just run itself.
    """
    if not at_once and stop.wait(interval_s):
        return
    while not stop.is_set():
        started = time.monotonic()
        try:
            step()
        except Exception:
            logger.exception("%s pass failed; next in %.1fs", name, interval_s)
        if stop.wait(max(0.0, interval_s - (time.monotonic() - started))):
            return


def start_periodic(
    step: Callable[[], object],
    stop: threading.Event,
    *,
    interval_s: float,
    name: str,
    at_once: bool = True,
) -> threading.Thread:
    """run_every(...) on a daemon thread named `name`, started."""
    thread = threading.Thread(
        target=run_every, args=(step, stop),
        kwargs={"interval_s": interval_s, "name": name, "at_once": at_once},
        name=name, daemon=True,
    )  # fmt: skip
    thread.start()
    return thread
