"""The scheduler's periodic loops: failures are retried at the next tick, stop ends them."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from scheduler.periodic import Periodic, Wakeup


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


def test_a_wakeup_brings_the_next_pass_forward_and_one_set_mid_pass_is_kept() -> None:
    stop = threading.Event()
    wakeup = Wakeup()
    passes: list[float] = []

    def step() -> None:
        passes.append(time.monotonic())
        if len(passes) == 1:
            wakeup.set()  # announced while the pass runs: the next one comes at once
        if len(passes) == 3:
            stop.set()

    thread = Periodic(step, 60.0, "batches", wakeup=wakeup).start(stop)
    deadline = time.monotonic() + 10
    while len(passes) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(passes) == 2
    wakeup.soon(0.2)
    thread.join(10)
    assert not thread.is_alive() and len(passes) == 3
    assert passes[1] - passes[0] < 5  # not the 60 s interval
    assert 0.15 < passes[2] - passes[1] < 5


def test_a_wakeup_wait_ends_on_stop_and_after_its_timeout() -> None:
    stop = threading.Event()
    wakeup = Wakeup()
    started = time.monotonic()
    assert wakeup.wait(stop, 0.05) is False
    assert time.monotonic() - started >= 0.05
    threading.Timer(0.1, stop.set).start()
    assert wakeup.wait(stop, 60.0) is True
    assert time.monotonic() - started < 5
