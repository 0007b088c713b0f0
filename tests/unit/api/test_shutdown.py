"""The app's shutdown ends within a bound, whatever its background parts do.

A lifespan that waits for ever on a part keeps `TestClient.__exit__` (and the server's
exit) waiting for ever: the long-poll hub's task must end even when a cancellation is lost
on the way, and a close that hangs is left behind after its bound.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import api.resources
from storage.job_done_hub import JobDoneHub
from tests.unit.api.conftest import ClientFactory

# Far below the test's own timeout, far above what a healthy shutdown takes.
BOUND_S = 30.0


async def _loses_the_first_cancellation(self: JobDoneHub) -> None:
    """The hub's loop as Python 3.11's wait_for can leave it: one cancellation swallowed
    as the awaited read completes, after which the loop would go round again."""
    lost = False
    while not self._closing:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            if lost:
                raise
            lost = True


def test_a_hub_that_loses_a_cancellation_still_stops(
        make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(JobDoneHub, "_run", _loses_the_first_cancellation)
    client = make_client()
    started = time.monotonic()
    client.__exit__(None, None, None)
    assert time.monotonic() - started < BOUND_S


def test_a_close_that_hangs_is_left_behind_after_its_bound(
        make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api.resources, "CLOSE_TIMEOUT_S", 0.5)
    client = make_client()
    resources: Any = client.app.state.resources  # type: ignore[attr-defined]
    never = threading.Event()
    resources.writer.close = lambda: never.wait()  # a join that never returns
    started = time.monotonic()
    try:
        client.__exit__(None, None, None)
        assert time.monotonic() - started < BOUND_S
    finally:
        never.set()
