"""The remote engine loop against a real HTTP server that holds every request open."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from core.messages import JobMessage
from storage.token_streams import StreamEntry
from tests.utils.engine_server import EngineServerFront, engine_server_front
from workers.engine import SamplingParams
from workers.inference.remote_engine import MAX_STREAM_CUTS, RemoteEngineLoop
from workers.inference.remote_servers import RemoteEngine, RemoteEngineConfig


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


class _Streams:
    """A real HTTP server answering each streamed request with the next script: SSE lines
    sent one by one, then the connection closed (a script without [DONE] is cut short)."""

    def __init__(self, scripts: list[list[str] | dict[str, Any]]) -> None:
        self.requests: list[dict[str, Any]] = []
        streams = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet."""

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                streams.requests.append(json.loads(raw))
                script = scripts.pop(0)
                self.send_response(200)
                if isinstance(script, dict):  # a server that ignores `stream`
                    data = json.dumps(script).encode()
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for line in script:
                    self.wfile.write(f"{line}\n\n".encode())
                    self.wfile.flush()
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _chunk(text: str = "", finish_reason: str | None = None) -> str:
    return "data: " + json.dumps({"choices": [
        {"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}]})


def _streamed_run(scripts: list[list[str] | dict[str, Any]]
                  ) -> tuple[list[Any], Any, list[dict[str, Any]]]:
    """One streamed chat job through a loop over `_Streams(scripts)`: the token entries
    handed on, its FinishedRequest, and the requests the server got."""
    streams = _Streams(scripts)
    entries: list[StreamEntry] = []
    loop = RemoteEngineLoop(RemoteEngine(RemoteEngineConfig(
        urls=[streams.url], model="m", backoff_s=0.01, backoff_max_s=0.01)))
    loop.token_sink = entries.extend
    loop.start()
    try:
        message = JobMessage(job_id="s", tenant_id="t", priority="high", model="m",
                             kind="chat.completion",
                             body={"messages": [{"role": "user", "content": "Hi"}],
                                   "max_tokens": 3, "stream": True})
        loop.add("s", "Hi", SamplingParams(max_tokens=3), 0, stream=True, job=message)
        (finished,) = loop.take_finished(20.0)
    finally:
        loop.stop(10)
        streams.close()
    return entries, finished, streams.requests


def test_a_stream_cut_short_is_asked_again_and_its_text_not_handed_on_twice() -> None:
    usage = 'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}'
    entries, finished, requests = _streamed_run([
        [_chunk("Hel"), _chunk("lo")],  # dropped before its end
        [_chunk("Hel"), _chunk("lo"), _chunk(" you", "length"), usage, "data: [DONE]"],
    ])
    assert finished.error is None and finished.output is not None
    message = finished.output.response["choices"][0]
    assert (message["message"]["content"], message["finish_reason"]) == ("Hello you", "length")
    assert finished.output.num_output_tokens == 3
    assert finished.output.metrics.first_token_time is not None
    assert [r["stream"] for r in requests] == [True, True]
    assert [(e.event, e.offset, e.text, e.finish_reason) for e in entries] == [
        ("started", None, "", None), (None, 0, "Hel", None), (None, 3, "lo", None),
        (None, 5, " you", None), (None, 9, "", "length")]


def test_an_error_event_mid_stream_fails_the_job_with_the_servers_words() -> None:
    _, finished, _ = _streamed_run([
        [_chunk("Hel"), 'data: {"error": {"message": "engine died", "code": 500}}']])
    assert finished.output is None
    assert finished.error == "the engine server ended the stream with an error: engine died"


def test_a_server_that_answers_a_stream_whole_is_taken_at_its_word() -> None:
    """Its answer is the job's, its text handed on in one piece (not asked again)."""
    whole = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!"},
                          "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 2, "completion_tokens": 2}}
    entries, finished, requests = _streamed_run([whole])
    assert finished.error is None and finished.output is not None
    assert finished.output.response["choices"][0]["message"]["content"] == "Hi!"
    assert len(requests) == 1
    assert [(e.event, e.offset, e.text, e.finish_reason) for e in entries] == [
        ("started", None, "", None), (None, 0, "Hi!", None), (None, 3, "", "stop")]


def test_an_answer_asked_again_that_does_not_go_on_from_the_streamed_text_fails() -> None:
    """The client has "Hel" already: a new answer "Bye" is not joined to it."""
    entries, finished, requests = _streamed_run([
        [_chunk("Hel")], [_chunk("Bye", "stop"), "data: [DONE]"]])
    assert len(requests) == 2 and finished.output is None
    assert "does not continue the text already streamed" in finished.error
    assert [e.text for e in entries if e.text] == ["Hel"]


def test_a_stream_cut_again_and_again_fails_its_job() -> None:
    cut = [_chunk("Hel")]
    _, finished, requests = _streamed_run([cut] * (MAX_STREAM_CUTS + 1))
    assert len(requests) == MAX_STREAM_CUTS + 1
    assert finished.error.startswith("the engine server ") and "cut the stream" in finished.error


def test_done_without_a_finish_reason_is_a_cut_stream() -> None:
    _, finished, requests = _streamed_run([
        [_chunk("Hi"), "data: [DONE]"], [_chunk("Hi"), _chunk("!", "stop"), "data: [DONE]"]])
    assert len(requests) == 2
    assert finished.output.response["choices"][0]["message"]["content"] == "Hi!"


@pytest.mark.parametrize(("line", "said"), [
    ('data: {"choices": [{"index": 0, "delta": "x"}]}', "delta is not an object"),
    ('data: {"choices": [{"index": 0, "delta": {"content": ["x"]}}]}', "text is not a string"),
    ('data: {"object": "error", "message": "engine died", "code": 500}', "engine died"),
])
def test_a_broken_chunk_or_an_old_error_event_fails_the_job(line: str, said: str) -> None:
    _, finished, requests = _streamed_run([[_chunk("Hel"), line]])
    assert len(requests) == 1 and finished.output is None
    assert said in finished.error
