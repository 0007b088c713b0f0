"""Bounds on what the server reads of a request besides its body: the bytes of its head
(request line and headers) and of its trailers, and the time its head may take.

uvicorn's httptools protocol reads a head whole however long it is, and waits for it as
long as the client likes: an 8 MB `Authorization` header was buffered, parsed and then
answered 401; one header that never ended grew the process without limit; a connection
that sent half a request line stayed open for good. h11, the other protocol, bounds the
bytes (`h11_max_incomplete_event_size`); this does the same for httptools, which is
several times faster at the thousands of submissions a second the API serves, and bounds
the time too.

- A head over `max_head_bytes` is answered 431 (Request Header Fields Too Large) and the
  connection closed, before the app sees the request. Two counts cover it: the request
  line and headers as the parser completes them, and, for reads wholly inside a head
  that has not ended, the raw bytes, so that one header that never completes is cut off
  too (the parser buffers it whole otherwise). Memory held per connection is then at most
  the bound and two socket reads. A head refused behind pipelined requests not yet
  answered gets no 431 (it would read as their answer): they are answered, then the
  connection closes.
- What follows a head and is not body (a chunked body's trailers and framing) is held to
  the same bound; past it the connection is closed (the app already has the request, so
  no status can be sent for it).
- A head not complete `head_timeout_s` after it began (or after the connection opened) is
  answered 408 and the connection closed; an idle connection between requests is
  uvicorn's keep-alive timeout's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

STATUS_LINES = {431: b"HTTP/1.1 431 Request Header Fields Too Large\r\n",
                408: b"HTTP/1.1 408 Request Timeout\r\n"}
# Bytes of framing allowed per chunk of a chunked body (its size line and CRLFs): they
# are not body, and are not what the tail bound is about.
CHUNK_FRAMING_BYTES = 64


class HeadTooLarge(Exception):
    """Raised from a parser callback: the parser stops, and the refusal goes out."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of the module docstring."""

    max_head_bytes = 64 * 1024
    head_timeout_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = False  # a request's head has begun and not ended
        self._in_message = False  # a request has begun and not ended
        self._num_heads = 0  # heads begun on this connection
        self._num_messages = 0  # requests ended on this connection
        self._head_bytes = 0  # the open head's request line and headers, as parsed
        self._raw_head_bytes = 0  # bytes received while it stayed open
        self._body_bytes = 0  # the request's body, as parsed
        self._num_chunks = 0  # its chunks, when chunked
        self._tail_bytes = 0  # bytes after its head that are not body: trailers, framing
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # nothing more is read from this connection
        was_open, was_in_message = self._head_open, self._in_message
        num_heads, num_messages = self._num_heads, self._num_messages
        num_body, num_chunks = self._body_bytes, self._num_chunks
        super().data_received(data)
        if self._refused:
            return
        # Counted only for reads wholly inside one head, or one body: a read in which a
        # request begins or ends may hold others, pipelined, of any size.
        if self._num_heads != num_heads or self._num_messages != num_messages:
            return
        if was_open and self._head_open:
            self._raw_head_bytes += len(data)
            if self._raw_head_bytes > self.max_head_bytes:
                self._refuse()
        elif was_in_message and not was_open and self._in_message:
            framing = CHUNK_FRAMING_BYTES * (self._num_chunks - num_chunks)
            self._tail_bytes += max(0, len(data) - (self._body_bytes - num_body) - framing)
            if self._tail_bytes > self.max_head_bytes:
                self._refuse()

    def on_message_begin(self) -> None:
        self._head_open = self._in_message = True
        self._num_heads += 1
        self._head_bytes = self._raw_head_bytes = 0
        self._body_bytes = self._num_chunks = self._tail_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + 4  # ": " and CRLF
        if self._head_open:
            self._count_head(size)
        else:  # a trailer of a chunked body
            self._tail_bytes += size
            if self._tail_bytes > self.max_head_bytes:
                self._refused = True
                raise HeadTooLarge
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_chunk_header(self) -> None:
        self._num_chunks += 1

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_message = False
        self._num_messages += 1

    def send_400_response(self, msg: str) -> None:
        if self._refused:  # the parser stopped at HeadTooLarge
            self._refuse()
            return
        super().send_400_response(msg)

    def _count_head(self, num_bytes: int) -> None:
        self._head_bytes += num_bytes
        if self._head_bytes > self.max_head_bytes:
            self._refused = True
            raise HeadTooLarge

    def _refuse(self) -> None:
        self._refused = True
        if self.transport.is_closing():
            return
        if self._in_message and not self._head_open:
            self.transport.close()  # past a head the app has: no status can follow
            return
        if self._is_answering():
            # Earlier requests on this connection (pipelined) are still being answered:
            # a 431 now would read as their answer. They are answered, then the
            # connection closes, the refused request unanswered.
            self.cycle.keep_alive = False
            return
        self._answer_and_close(431, f"The request line and headers exceed "
                               f"{self.max_head_bytes} bytes.",
                               "request_header_fields_too_large")

    def _is_answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._refused:
            return
        if not self._head_open and self._num_heads:
            return  # between requests: the keep-alive timeout's
        if self._is_answering():
            self._arm_head_timer()  # a request before it is still being answered
            return
        self._refused = True
        self._answer_and_close(408, f"The request's line and headers did not arrive "
                               f"within {self.head_timeout_s:g} s.", "request_timeout")

    def _answer_and_close(self, status: int, message: str, code: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": code}}).encode()
        self.transport.write(b"".join([
            STATUS_LINES[status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
        self.transport.close()


def bounded_http_config(max_head_bytes: int, head_timeout_s: float) -> dict[str, Any]:
    """`uvicorn.Config` keywords bounding a request's head to `max_head_bytes` (and, with
    httptools, its trailers too, and its head's arrival to `head_timeout_s`)."""
    protocol = type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,),
                    {"max_head_bytes": max_head_bytes, "head_timeout_s": head_timeout_s})
    return {"http": protocol, "h11_max_incomplete_event_size": max_head_bytes}
