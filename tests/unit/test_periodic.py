"""The scheduler's periodic loops: failures are retried at the next tick, stop ends them."""

from __future__ import annotations

import logging
import threading

import pytest

from scheduler.periodic import run_every, start_periodic


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
        run_every(step, stop, interval_s=0.001, name="reconciler")
    assert calls == [0, 1, 2]
    assert "reconciler pass failed" in caplog.text and "broker away" in caplog.text


def test_not_at_once_waits_an_interval_first_and_stop_wins() -> None:
    stop = threading.Event()
    stop.set()
    calls: list[None] = []
    run_every(lambda: calls.append(None), stop, interval_s=0.001, name="file-expiry",
              at_once=False)  # fmt: skip
    assert calls == []


def test_start_periodic_runs_on_a_named_daemon_thread_that_stop_ends() -> None:
    stop = threading.Event()
    first = threading.Event()
    thread = start_periodic(first.set, stop, interval_s=0.001, name="batches")
    assert first.wait(10)
    assert thread.name == "batches" and thread.daemon
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
