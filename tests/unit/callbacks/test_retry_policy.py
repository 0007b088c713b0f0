"""Retry classification, backoff growth with jitter bounds, and Retry-After parsing."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from workers.callbacks.retry_policy import (
    JITTER_FRACTION,
    MAX_RETRY_AFTER_S,
    Verdict,
    classify_status,
    parse_retry_after,
    retry_delay,
)

DEFAULT_SCHEDULE = [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0]


@pytest.mark.parametrize(
    ("status_code", "verdict"),
    [
        (200, Verdict.SUCCEEDED), (201, Verdict.SUCCEEDED), (204, Verdict.SUCCEEDED),
        (408, Verdict.RETRY), (429, Verdict.RETRY), (500, Verdict.RETRY),
        (502, Verdict.RETRY), (503, Verdict.RETRY), (599, Verdict.RETRY),
        (410, Verdict.FAILED), (400, Verdict.FAILED), (401, Verdict.FAILED),
        (404, Verdict.FAILED), (400, Verdict.FAILED),
        (301, Verdict.FAILED), (302, Verdict.FAILED), (307, Verdict.FAILED),
        (101, Verdict.FAILED),
    ],
)
def test_classify_status(status_code: int, verdict: Verdict) -> None:
    assert classify_status(status_code) is verdict


def test_delays_follow_the_schedule_within_jitter_bounds() -> None:
    rng = random.Random(7)
    for num_attempts, base in enumerate(DEFAULT_SCHEDULE, start=1):
        for _ in range(200):
            delay = retry_delay(num_attempts=num_attempts, schedule=DEFAULT_SCHEDULE, rng=rng)
            assert delay is not None
            assert base * (1 - JITTER_FRACTION) <= delay <= base * (1 + JITTER_FRACTION)


def test_delays_grow_and_are_jittered() -> None:
    schedule = [0.5, 1.0, 2.0]
    rng = random.Random(1)
    for _ in range(200):
        delays = [retry_delay(num_attempts=n, schedule=schedule, rng=rng) for n in (1, 2, 3)]
        assert delays[0] is not None and delays[1] is not None and delays[2] is not None
        assert delays[0] < delays[1] < delays[2]
    draws = {retry_delay(num_attempts=1, schedule=schedule, rng=rng) for _ in range(50)}
    assert len(draws) > 40  # jitter: receivers failing together do not retry together


def test_schedule_exhausted_gives_up() -> None:
    assert retry_delay(num_attempts=3, schedule=[1.0, 2.0]) is None
    assert retry_delay(num_attempts=len(DEFAULT_SCHEDULE) + 1, schedule=DEFAULT_SCHEDULE) is None
    with pytest.raises(ValueError):
        retry_delay(num_attempts=0, schedule=[1.0])


def test_retry_after_is_honoured_when_longer() -> None:
    rng = random.Random(3)
    assert retry_delay(num_attempts=1, schedule=[5.0], retry_after_s=120.0, rng=rng) == 120.0
    shorter = retry_delay(num_attempts=1, schedule=[5.0], retry_after_s=1.0, rng=rng)
    assert shorter is not None and shorter >= 5.0 * (1 - JITTER_FRACTION)
    # Exhausted stays exhausted whatever the receiver asks.
    assert retry_delay(num_attempts=2, schedule=[5.0], retry_after_s=1.0) is None


def test_parse_retry_after_seconds() -> None:
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after("99999999") == MAX_RETRY_AFTER_S


def test_parse_retry_after_http_date() -> None:
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    header = format_datetime(now + timedelta(seconds=90), usegmt=True)
    assert parse_retry_after(header, now=now) == pytest.approx(90.0)
    past = format_datetime(now - timedelta(hours=1), usegmt=True)
    assert parse_retry_after(past, now=now) == 0.0


@pytest.mark.parametrize("value", [None, "", "soon", "-5", "1.5", "Mon, 99 Foo 2026"])
def test_parse_retry_after_ignores_garbage(value: str | None) -> None:
    assert parse_retry_after(value) is None
