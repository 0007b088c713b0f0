"""The scheduler's periodic loops: failures are retried at the next tick, stop ends them."""

from __future__ import annotations

import logging
import threading

import pytest

from scheduler.periodic import Periodic


def test_a_failing_step_is_logged_and_retried_until_stop(caplog: pytest.LogCaptureFixture) -> None:
    stop = threading.Event()
    calls: list[int] = []

    def step() -> None:
        calls.append(len(calls))
        if len(calls) == 3:
            stop.set()
        if len(calls) == 1:
            raise RuntimeError("broker away")

    with caplog.at_level(logging.ERROR, logger="scheduler.periodic"):
        Periodic(step, 0.001, "reconciler").run(stop)
    assert calls == [0, 1, 2]
    assert "reconciler pass failed" in caplog.text and "broker away" in caplog.text


def test_not_at_once_waits_an_interval_first_and_stop_wins() -> None:
    stop = threading.Event()
    stop.set()
    calls: list[None] = []
    Periodic(lambda: calls.append(None), 0.001, "file-expiry", at_once=False).run(stop)
    assert calls == []


def test_start_runs_on_a_named_daemon_thread_that_stop_ends() -> None:
    stop = threading.Event()
    first = threading.Event()
    thread = Periodic(first.set, 0.001, "batches").start(stop)
    assert first.wait(10)
    assert thread.name == "batches" and thread.daemon
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
