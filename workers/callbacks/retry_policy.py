"""What one attempt's outcome means for a delivery: done, retry later, or give up.

2xx succeeds. Timeouts, connection errors, 408, 429 and 5xx are retried after the next
delay of the schedule (with jitter, and no sooner than a `Retry-After` asks); 410 stops at
once; a redirect (redirects are not followed) and every other 4xx fail at once. The
schedule lists the delays before the 1st, 2nd, ... retry, so a delivery gets at most
`len(schedule) + 1` attempts.
"""

from __future__ import annotations

import enum
import random
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

# Each delay is scaled by a factor drawn from [1 - JITTER, 1 + JITTER], so receivers that
# failed together do not all retry in the same second. With a schedule that at least
# doubles per step (5 s, 5 min, ...), 0.2 keeps every delay longer than the one before.
JITTER_FRACTION = 0.2
# A receiver's Retry-After is honoured up to this many seconds.
MAX_RETRY_AFTER_S = 86_400.0

RETRIABLE_STATUS_CODES = frozenset({408, 429})


class Verdict(enum.StrEnum):
    """What an attempt's outcome means for the delivery."""

    SUCCEEDED = "succeeded"
    RETRY = "retry"
    FAILED = "failed"


def classify_status(status_code: int) -> Verdict:
    """The verdict for an HTTP answer (a 3xx is a failure: redirects are not followed)."""
    if 200 <= status_code < 300:
        return Verdict.SUCCEEDED
    if status_code in RETRIABLE_STATUS_CODES or 500 <= status_code < 600:
        return Verdict.RETRY
    # 410 Gone, the other 4xx, 3xx and anything odd: retrying would not help.
    return Verdict.FAILED


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds a `Retry-After` header asks to wait (delta-seconds or HTTP-date), or None."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text.isdigit():
        return min(float(text), MAX_RETRY_AFTER_S)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    seconds = (when - (now or datetime.now(UTC))).total_seconds()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def retry_delay(
    *,
    num_attempts: int,
    schedule: list[float],
    retry_after_s: float | None = None,
    rng: random.Random | None = None,
) -> float | None:
    """Seconds until the next attempt after `num_attempts` failed ones; None: give up.

    Example with schedule [5, 300]: after attempt 1 wait 4-6 s, after attempt 2 wait
    240-360 s, after attempt 3 give up.
    """
    if num_attempts < 1:
        raise ValueError("num_attempts counts the attempts made so far, at least 1")
    if num_attempts > len(schedule):
        return None
    jitter = (rng or random).uniform(1.0 - JITTER_FRACTION, 1.0 + JITTER_FRACTION)
    delay = schedule[num_attempts - 1] * jitter
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, MAX_RETRY_AFTER_S))
    return delay
