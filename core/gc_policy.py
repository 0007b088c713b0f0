"""The garbage collector's settings for the long-running service processes.

With CPython's defaults (a young collection every 700 net allocations) a busy API process
collected its young generation every ~6 ms, so the objects of every request in flight
(32 at a time, each ~25 ms old) survived two collections and were promoted to the oldest
generation, where they died. That made a full collection of the whole heap run about once
a second, 100-280 ms each with the event loop stopped: the API's p99 latency and ~18% of
its CPU (bench/RESULTS.md). Here:
- the heap built at start-up (modules, tokenizers, the model, ORM metadata) is frozen out
  of every later collection (`gc.freeze`), and
- the young generation is collected every YOUNG_THRESHOLD allocations, so a request's
  objects are usually freed before a collection could promote them.
Reference counting still frees acyclic garbage at once; only cycles wait a little longer.
"""

from __future__ import annotations

import atexit
import gc
import logging

logger = logging.getLogger(__name__)

YOUNG_THRESHOLD = 50_000
# Collections of the younger generation between collections of the next (CPython's 10).
OLDER_THRESHOLD = 10


_thaw_registered = False


def freeze_heap() -> None:
    """Move every live object out of later collections (`gc.freeze`), thawed again at exit
    so that shutdown collects them: frozen, Triton's bindings (torch imports them) report
    dozens of leaked objects on stderr as the process ends."""
    global _thaw_registered
    gc.collect()
    gc.freeze()
    if not _thaw_registered:
        atexit.register(gc.unfreeze)
        _thaw_registered = True


def settle_heap() -> None:
    """Call once a process has loaded what it keeps for life, before it starts serving."""
    freeze_heap()
    gc.set_threshold(YOUNG_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD)
    logger.debug("gc: %d start-up objects frozen, thresholds %s",
                 gc.get_freeze_count(), gc.get_threshold())
