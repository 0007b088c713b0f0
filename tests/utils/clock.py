"""A clock for tests: seconds that move only when the test says so."""

from __future__ import annotations


class ManualClock:
    """Callable like time.monotonic; `now` moves only when a test sets or advances it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
