"""A bound on the bytes of a request's head (request line and headers) the server reads.

uvicorn's httptools protocol reads a head whole however long it is: an 8 MB
`Authorization` header was buffered, parsed and then answered 401, and a client sending
one header that never ends grew the process without limit. h11, the other protocol, has
a limit (`h11_max_incomplete_event_size`); this is the same for httptools, which is
several times faster at the thousands of submissions a second the API serves.

A head over `max_head_bytes` is answered 431 (Request Header Fields Too Large) and the
connection closed, before the app sees the request. Two counts cover it: the request
line and headers as the parser completes them, and, while the head has not ended, the
raw bytes received, so that one header that never completes is cut off too (the parser
buffers it whole otherwise). Memory held per connection is then at most the bound and
two socket reads. A head refused behind pipelined requests not yet answered gets no 431
(it would read as their answer): they are answered, then the connection closed.
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

STATUS_LINE = b"HTTP/1.1 431 Request Header Fields Too Large\r\n"


class HeadTooLarge(Exception):
    """Raised from a parser callback: the parser stops, and the 431 goes out."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing heads over `max_head_bytes`."""

    max_head_bytes = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = False  # a request's head has begun and not ended
        self._num_heads = 0  # heads begun on this connection
        self._head_bytes = 0  # its request line and headers, as parsed
        self._raw_head_bytes = 0  # bytes received while it stayed open
        self._head_too_large = False

    def data_received(self, data: bytes) -> None:
        if self._head_too_large:
            return  # refused: nothing more is read from this connection
        was_open, num_heads = self._head_open, self._num_heads
        super().data_received(data)
        # Counted only for reads wholly inside one open head: a read in which a head
        # begins may hold earlier requests, pipelined, and their bodies, of any size.
        if (was_open and self._head_open and self._num_heads == num_heads
                and not self._head_too_large):
            self._raw_head_bytes += len(data)
            if self._raw_head_bytes > self.max_head_bytes:
                self._refuse()

    def on_message_begin(self) -> None:
        self._head_open = True
        self._num_heads += 1
        self._head_bytes = self._raw_head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_open:  # not a chunked body's trailers, which come after the head
            self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open = False
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:  # the parser stopped at HeadTooLarge
            self._refuse()
            return
        super().send_400_response(msg)

    def _count(self, num_bytes: int) -> None:
        self._head_bytes += num_bytes
        if self._head_bytes > self.max_head_bytes:
            self._head_too_large = True
            raise HeadTooLarge

    def _refuse(self) -> None:
        self._head_too_large = True
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # Earlier requests on this connection (pipelined) are still being answered:
            # a 431 now would read as their answer. They are answered, then the
            # connection closes, the refused request unanswered.
            self.cycle.keep_alive = False
            return
        body = json.dumps({"error": {
            "message": f"The request line and headers exceed {self.max_head_bytes} bytes.",
            "type": "invalid_request_error", "param": None,
            "code": "request_header_fields_too_large"}}).encode()
        self.transport.write(b"".join([
            STATUS_LINE, b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
        self.transport.close()


def bounded_http_config(max_head_bytes: int) -> dict[str, Any]:
    """`uvicorn.Config` keywords bounding a request's head to `max_head_bytes`."""
    protocol = type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,),
                    {"max_head_bytes": max_head_bytes})
    return {"http": protocol, "h11_max_incomplete_event_size": max_head_bytes}

