"""The running test's time before pytest-timeout ends it, for the waits of the tests.

A wait given `within_budget(timeout)` ends MARGIN_S before the test's own timeout at the
latest, however long it was asked to be and however many waits came before it, so a test
that hangs fails with its wait's message (the state it saw, the services' log tails)
rather than pytest-timeout's bare stack dump, and its teardown still has time to stop
what it started. `tests/conftest.py` starts the clock as each test's setup begins (the
timeout covers setup, call and teardown).
"""

from __future__ import annotations

import time

# Left for the failure's report and the teardown; a quarter of a short timeout.
MARGIN_S = 30.0
# A wait cut to less than this (the budget is spent) still looks once or twice.
MIN_WAIT_S = 1.0

_deadline: float | None = None


def begin_test(timeout_s: float | None) -> None:
    """Start the running test's clock; None or 0: no timeout, waits are not cut."""
    global _deadline
    if not timeout_s or timeout_s <= 0:
        _deadline = None
        return
    _deadline = time.monotonic() + timeout_s - min(MARGIN_S, timeout_s / 4)


def within_budget(timeout: float) -> float:
    """`timeout`, cut so the wait ends before the running test's timeout."""
    if _deadline is None:
        return timeout
    return max(MIN_WAIT_S, min(timeout, _deadline - time.monotonic()))
