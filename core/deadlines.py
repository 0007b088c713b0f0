"""Durations and deadlines as clients write them: `30m`, `2h`, `24h`, `7d`; RFC 3339 times
or seconds from now. One place for the limits, so jobs and batches accept the same."""

from __future__ import annotations

from datetime import datetime, timedelta

# A completion window or deadline lies between one minute and seven days from now.
MIN_WINDOW_S = 60
MAX_WINDOW_S = 7 * 86_400
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
# Within a priority the engine orders by deadline only the jobs due within this long of
# reaching it; the rest (no deadline, a 2 h or 24 h batch window) share by tenant. When
# every deadline ordered, no-deadline jobs sorted after them all: every line of a 24 h
# batch ran before any other tenant's job of its priority.
DEFAULT_DUE_S = 3600.0


def duration_seconds(text: str) -> int:
    """Seconds in `<n>s|m|h|d` (`90s`, `30m`, `2h`, `7d`); ValueError for anything else."""
    number, unit = text[:-1], text[-1:]
    # ASCII digits only: str.isdigit() also takes "١", "１" and "²" (the last not even
    # for int()), which a duration written for OpenAI's API never holds.
    if unit not in _UNITS or not (number.isascii() and number.isdigit()) or int(number) <= 0:
        raise ValueError(f"{text!r} is not a duration like 30m, 2h, 24h or 7d")
    return int(number) * _UNITS[unit]


def check_window(seconds: float, *, what: str) -> None:
    """ValueError unless `seconds` lies between one minute and seven days."""
    if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        raise ValueError(f"{what} must be between 1 minute and 7 days from now, "
                         f"got {seconds:g} s")


def resolve_deadline(value: datetime | float, *, now: datetime) -> datetime:
    """An absolute deadline from an RFC 3339 time (with its offset) or seconds from now;
    ValueError when it has no offset or lies outside one minute to seven days ahead."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("deadline needs a UTC offset, e.g. 2026-11-29T12:00:00Z")
        check_window((value - now).total_seconds(), what="deadline")
        return value
    check_window(float(value), what="deadline")
    return now + timedelta(seconds=float(value))
