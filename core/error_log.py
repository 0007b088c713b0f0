"""Logging of unexpected errors that clients can trigger at will: bounded, never a flood.

A traceback per request lets anyone who can reach the port fill the log (and its disk)
with the same 30 lines. `ErrorLog` writes the first traceback of each error type (and
place) per window, then only counts: the next traceback of that type says how many were
left out meanwhile. Nothing is lost to the operator but repetition; the per-type counts
go to the metrics (the caller counts every error, logged or not).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

# One traceback per error type and place per this many seconds.
TRACEBACK_WINDOW_S = 60.0
# Most (type, place) keys remembered; the oldest go first (types are few: code paths).
MAX_KEYS = 1024


class ErrorLog:
    """`exception()` logs like `logger.exception`, at most once per key per window."""

    def __init__(self, logger: logging.Logger, *, window_s: float = TRACEBACK_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._logged_at: dict[str, float] = {}
        self._num_left_out: dict[str, int] = {}

    def exception(self, error: BaseException, message: str, *args: object,
                  place: str = "") -> bool:
        """Log `message` with `error`'s traceback unless one of its kind was logged within
        the window; True when it was logged now."""
        key = f"{type(error).__module__}.{type(error).__qualname__}@{place}"
        now = self._clock()
        with self._lock:
            logged_at = self._logged_at.get(key)
            if logged_at is not None and now - logged_at < self.window_s:
                self._num_left_out[key] = self._num_left_out.get(key, 0) + 1
                return False
            self._logged_at.pop(key, None)
            self._logged_at[key] = now
            while len(self._logged_at) > MAX_KEYS:
                self._num_left_out.pop(next(iter(self._logged_at)), None)
                del self._logged_at[next(iter(self._logged_at))]
            num_left_out = self._num_left_out.pop(key, 0)
        if num_left_out:
            message = (f"{message} ({num_left_out} more like it since the last traceback "
                       "were counted, not logged)")
        self.logger.error(message, *args, exc_info=error)
        return True
