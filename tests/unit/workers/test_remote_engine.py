"""The remote engine loop against a real HTTP server that holds every request open."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from core.messages import JobMessage
from tests.utils.engine_server import EngineServerFront, engine_server_front
from workers.engine import SamplingParams
from workers.inference.remote_engine import RemoteEngine, RemoteEngineConfig, RemoteEngineLoop


def wait_until(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def job(job_id: str, priority: str) -> JobMessage:
    return JobMessage(job_id=job_id, tenant_id="t", priority=priority, model="m",
                      kind="text_completion", body={"prompt": job_id, "max_tokens": 3})


@pytest.fixture
def held() -> Iterator[tuple[EngineServerFront, RemoteEngineLoop]]:
    """A loop over one server that takes one request at a time and answers none."""
    with engine_server_front(None, model="m") as front:
        loop = RemoteEngineLoop(RemoteEngine(RemoteEngineConfig(urls=[front.url], model="m",
                                                                concurrency=1)))
        loop.start()
        try:
            yield front, loop
        finally:
            loop.stop(10)


def add(loop: RemoteEngineLoop, message: JobMessage, rank: int) -> None:
    loop.add(message.job_id, message.body["prompt"], SamplingParams(max_tokens=3), rank,
             job=message)


def test_a_freed_place_goes_to_the_most_urgent_waiting_request(
        held: tuple[EngineServerFront, RemoteEngineLoop]) -> None:
    front, loop = held
    add(loop, job("first-low", "low"), 2)
    wait_until("the first request to be held", lambda: len(front.requests) == 1)
    add(loop, job("second-low", "low"), 2)
    add(loop, job("third-high", "high"), 0)
    loop.abort("first-low")
    wait_until("the next request", lambda: len(front.requests) == 2)
    assert front.requests[1]["prompt"] == "third-high"
    (aborted,) = loop.take_finished(5.0)
    assert aborted.request_id == "first-low" and aborted.aborted
    wait_until("the aborted request's connection to close", front.closed.is_set)


def test_aborting_a_waiting_request_never_sends_it(
        held: tuple[EngineServerFront, RemoteEngineLoop]) -> None:
    front, loop = held
    add(loop, job("running", "normal"), 1)
    wait_until("the first request to be held", lambda: len(front.requests) == 1)
    add(loop, job("waiting", "high"), 0)
    add(loop, job("after", "low"), 2)
    loop.abort("waiting")
    (aborted,) = loop.take_finished(5.0)
    assert aborted.request_id == "waiting" and aborted.aborted
    loop.abort("running")
    wait_until("the next request", lambda: len(front.requests) == 2)
    assert front.requests[1]["prompt"] == "after"


def test_an_embedding_job_is_refused_with_a_reason(
        held: tuple[EngineServerFront, RemoteEngineLoop]) -> None:
    _, loop = held
    message = JobMessage(job_id="e", tenant_id="t", priority="low", model="m", kind="embedding",
                         body={"input": "x"})
    loop.add("e", "x", SamplingParams(max_tokens=1), 2, job=message)
    (refused,) = loop.take_finished(5.0)
    assert refused.error is not None and "embedding" in refused.error
