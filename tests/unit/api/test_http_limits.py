"""A request's head is read up to a bound of bytes and of time: past it, 431 or 408 and
the connection closed; a chunked body's trailers are held to the bound too.

A real uvicorn server on a socket, with the protocol the API runs (api.http_limits), a
bound of 4 KiB and 1 s, spoken to byte by byte."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request

from api.http_limits import bounded_http_config
from scheduler.embedded_services import free_port

LIMIT = 4096
HEAD_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = FastAPI()

    @app.api_route("/echo", methods=["GET", "POST"])
    async def echo(request: Request) -> dict[str, int]:
        return {"body": len(await request.body()), "headers": len(request.headers)}

    @app.get("/slow")
    async def slow() -> dict[str, int]:
        await asyncio.sleep(0.3)
        return {"body": 0, "headers": 0}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="error",
                                           **bounded_http_config(LIMIT, HEAD_TIMEOUT_S)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def _head(path: str = "/echo", method: str = "GET", headers: dict[str, str] | None = None,
          body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _answers(sock: socket.socket) -> list[tuple[int, bytes]]:
    """Every response read until the server closes or goes quiet: (status, body)."""
    sock.settimeout(5)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    answers = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        answers.append((status, rest[:length]))
        data = rest[length:]
    return answers


def _send(port: int, *requests: bytes, close: bool = True) -> list[tuple[int, bytes]]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for request in requests:
            sock.sendall(request)
        if close:
            sock.shutdown(socket.SHUT_WR)
        return _answers(sock)


def test_a_head_within_the_bound_is_served(port: int) -> None:
    [(status, body)] = _send(port, _head(headers={"Authorization": "x" * (LIMIT - 200)}))
    assert status == 200 and json.loads(body)["headers"] == 2


@pytest.mark.parametrize("request_bytes", [
    _head(headers={"Authorization": "x" * (LIMIT + 1)}),  # one long header
    _head(headers={f"X-{i}": "y" * 100 for i in range(60)}),  # many short ones
    _head(path="/echo?q=" + "z" * LIMIT),  # a long request line
])
def test_a_head_past_the_bound_is_431_and_the_connection_closed(
        port: int, request_bytes: bytes) -> None:
    [(status, body)] = _send(port, request_bytes, close=False)  # closed by the server
    assert status == 431
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


def test_a_header_that_never_ends_is_cut_off_at_the_bound(port: int) -> None:
    """Sent in pieces and never finished: answered 431 soon after the bound is passed,
    with the head still open (the parser would buffer it whole otherwise)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: test\r\nX-Endless: ")
        sent, deadline = 0, time.monotonic() + 60
        while not select.select([sock], [], [], 0.001)[0]:
            assert time.monotonic() < deadline, f"no answer after {sent} bytes"
            sock.sendall(b"a" * 512)
            sent += 512
        [(status, _)] = _answers(sock)
    assert status == 431
    assert sent > LIMIT


def test_the_bound_is_per_request_on_a_kept_connection(port: int) -> None:
    """Requests one after another on one connection, their heads together past the bound;
    then three sent at once (pipelined) in one read."""
    head = _head(headers={"Authorization": "x" * (LIMIT // 2)})
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        for _ in range(3):
            sock.sendall(head)
            answer = b""
            while not answer.endswith(b"}"):
                answer += sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer
    last = _head(headers={"Authorization": "x" * (LIMIT // 2), "Connection": "close"})
    assert [status for status, _ in _send(port, head * 2 + last, close=False)] == [200] * 3


def test_a_body_arriving_with_its_head_does_not_count(port: int) -> None:
    body = b"b" * (50 * LIMIT)
    [(status, answer)] = _send(port, _head(method="POST", body=body))
    assert status == 200 and json.loads(answer)["body"] == len(body)


def test_a_head_is_not_charged_with_the_reads_of_the_request_before_it(port: int) -> None:
    """A POST whose head and 20 KB body span reads, then a small GET begun in the same
    read as the body's end: both answered (the GET's head is small)."""
    post = _head(method="POST", body=b"p" * (5 * LIMIT))
    get = _head(headers={"Connection": "close"})
    cut = post.index(b"\r\n\r\n") // 2
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for piece in (post[:cut], post[cut:] + get[:10], get[10:]):
            sock.sendall(piece)
            time.sleep(0.05)
        assert [status for status, _ in _answers(sock)] == [200, 200]


def _chunked(trailer: bytes) -> bytes:
    return (b"POST /echo HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\nX-Pad: " + b"h" * (LIMIT // 2) + b"\r\n\r\n"
            b"3\r\nabc\r\n0\r\n" + trailer)


def test_trailers_are_bounded_apart_from_the_head(port: int) -> None:
    """Head and trailers each within the bound, together past it: served."""
    [(status, body)] = _send(port, _chunked(b"X-Trailer: " + b"t" * (LIMIT // 2) + b"\r\n\r\n"),
                             close=False)
    assert status == 200 and json.loads(body)["body"] == 3


@pytest.mark.parametrize("trailer", [
    b"X-Trailer: " + b"t" * (LIMIT + 1) + b"\r\n\r\n",  # one long trailer
    b"X-Trailer: " + b"t" * (20 * LIMIT),  # one that never ends
])
def test_trailers_past_the_bound_close_the_connection(port: int, trailer: bytes) -> None:
    """The app has the request already: no status can be sent, the connection closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        request = _chunked(b"")
        sock.sendall(request)
        for start in range(0, len(trailer), 512):
            try:
                sock.sendall(trailer[start:start + 512])
            except OSError:
                break
            time.sleep(0.001)
        sock.settimeout(5)
        try:
            assert sock.recv(65536) == b""  # closed by the server, with no answer
        except ConnectionResetError:
            pass  # closed with unread bytes: reset


def test_a_head_not_finished_in_time_is_408(port: int) -> None:
    """Half a request line, a header a byte at a time, or nothing at all."""
    for sent in (b"GET /ec", b"GET /echo HTTP/1.1\r\nHost: te", b""):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            sock.sendall(sent)
            [(status, body)] = _answers(sock)
            waited = time.monotonic() - started
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert HEAD_TIMEOUT_S * 0.9 <= waited < HEAD_TIMEOUT_S + 4


def test_a_slow_answer_is_not_a_slow_head(port: int) -> None:
    """A request whose answer takes its time, and the next one on the connection after a
    pause, are served: the bound is on heads arriving, not on the app or idle time."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for path in ("/slow", "/slow", "/echo"):
            sock.sendall(_head(path=path))
            answer = b""
            while not answer.endswith(b"}"):
                answer += sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            time.sleep(HEAD_TIMEOUT_S / 2)


def test_a_head_too_large_behind_an_unanswered_request_closes_after_its_answer(
        port: int) -> None:
    """Pipelined behind a request still running: that request gets its own answer (not a
    431 in its place), then the connection closes."""
    big = _head(headers={"Authorization": "x" * (LIMIT + 1)})
    answers = _send(port, _head(path="/slow") + big, close=False)
    assert [status for status, _ in answers] == [200]
