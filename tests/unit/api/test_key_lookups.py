"""Requests of one key that miss the key cache together share one database lookup."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

import api.auth
from api.auth import CurrentTenant, look_up_key_shared
from api.single_flight import SingleFlight

ACME = CurrentTenant(id="ten_1", name="acme")


def _counting_lookup(monkeypatch: pytest.MonkeyPatch, answer: Any) -> list[str]:
    """Replace the database lookup by one that takes 50 ms; returns the keys it was asked."""
    asked: list[str] = []
    lock = threading.Lock()

    def look_up(resources: Any, key: str) -> CurrentTenant | None:
        with lock:
            asked.append(key)
        time.sleep(0.05)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    monkeypatch.setattr(api.auth, "look_up_key", look_up)
    return asked


def test_concurrent_misses_of_one_key_share_a_lookup_and_the_next_miss_asks_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = _counting_lookup(monkeypatch, ACME)
    resources: Any = SimpleNamespace(key_lookups=SingleFlight())

    async def main() -> None:
        first = await asyncio.gather(*(look_up_key_shared(resources, "bi_a", "ha")
                                       for _ in range(20)),
                                     look_up_key_shared(resources, "bi_b", "hb"))
        assert first == [ACME] * 21
        assert sorted(asked) == ["bi_a", "bi_b"]
        assert len(resources.key_lookups) == 0  # nothing kept once answered
        assert await look_up_key_shared(resources, "bi_a", "ha") == ACME
        assert asked.count("bi_a") == 2

    asyncio.run(main())


def test_a_waiter_that_leaves_does_not_cancel_the_others_and_errors_reach_every_waiter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    resources: Any = SimpleNamespace(key_lookups=SingleFlight())

    async def leave_early() -> None:
        leaving = asyncio.ensure_future(look_up_key_shared(resources, "bi_a", "ha"))
        staying = asyncio.ensure_future(look_up_key_shared(resources, "bi_a", "ha"))
        await asyncio.sleep(0.01)
        leaving.cancel()
        assert await staying == ACME

    _counting_lookup(monkeypatch, ACME)
    asyncio.run(leave_early())

    async def fail_together() -> None:
        results = await asyncio.gather(*(look_up_key_shared(resources, "bi_a", "ha")
                                         for _ in range(3)), return_exceptions=True)
        assert [str(r) for r in results] == ["database down"] * 3
        assert len(resources.key_lookups) == 0

    _counting_lookup(monkeypatch, ConnectionError("database down"))
    asyncio.run(fail_together())
