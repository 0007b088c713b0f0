"""A small real HTTP server standing in front of an OpenAI-compatible engine server, for
tests of workers that drive engine servers: it records every request, answers the first
ones with the statuses it is given (503, 429...), forwards the rest to the server behind
it (our own API in front of a tiny model), or holds them unanswered until the client
closes the connection.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx


@dataclass
class EngineServerFront:
    """What the front does and what it saw (read from the test thread)."""

    upstream: str | None  # base URL ending in /v1; None: hold every completion request
    model: str  # listed at GET /v1/models when there is no upstream
    # (status, headers) answered to the first completion requests, in order.
    refusals: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)  # bodies of completions
    answered: list[int] = field(default_factory=list)  # the status of each, in order
    held: threading.Event = field(default_factory=threading.Event)  # a request is held
    closed: threading.Event = field(default_factory=threading.Event)  # ... and its client left
    # Set: every completion request is read, then its connection closed unanswered.
    down: threading.Event = field(default_factory=threading.Event)
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(front: EngineServerFront) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet."""

        def do_GET(self) -> None:
            if front.upstream is not None:
                self._forward("GET", None)
            else:
                self._answer(200, {"object": "list", "data": [{"id": front.model}]})

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with front.lock:
                front.requests.append(json.loads(raw))
                refusal = front.refusals.pop(0) if front.refusals else None
            if front.down.is_set():
                self.close_connection = True  # dropped: no status line at all
            elif refusal is not None:
                status, headers = refusal
                self._answer(status, {"error": {"message": "busy", "code": status}}, headers)
            elif front.upstream is None:
                self._hold()
            else:
                self._forward("POST", raw)

        def _hold(self) -> None:
            front.held.set()
            self.connection.settimeout(120)
            # A client that closes its connection makes this read return b"".
            while self.connection.recv(1):
                pass
            front.closed.set()
            self.close_connection = True

        def _forward(self, method: str, raw: bytes | None) -> None:
            assert front.upstream is not None
            path = self.path.removeprefix("/v1")
            headers = {"Authorization": self.headers.get("Authorization", ""),
                       "Content-Type": "application/json"}
            try:
                if raw is not None and json.loads(raw).get("stream"):
                    self._forward_stream(front.upstream + path, raw, headers)
                    return
                answer = httpx.request(method, front.upstream + path, content=raw,
                                       headers=headers, timeout=120)
            except httpx.HTTPError:
                self._answer(502, {"error": {"message": "upstream unreachable"}})
                return
            self._answer(answer.status_code, answer.content)

        def _forward_stream(self, url: str, raw: bytes, headers: dict[str, str]) -> None:
            """A streamed answer passed on chunk by chunk as it comes (then the connection
            is closed: its end is the body's end)."""
            with httpx.stream("POST", url, content=raw, headers=headers,
                              timeout=120) as answer:
                with front.lock:
                    front.answered.append(answer.status_code)
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", ""))
                self.send_header("Connection", "close")
                self.end_headers()
                for chunk in answer.iter_raw():
                    self.wfile.write(chunk)
                    self.wfile.flush()
            self.close_connection = True

        def _answer(self, status: int, body: object,
                    headers: dict[str, str] | None = None) -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            if self.command == "POST":
                with front.lock:
                    front.answered.append(status)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

    return Handler


@contextmanager
def engine_server_front(upstream: str | None, *, model: str,
                        refusals: list[tuple[int, dict[str, str]]] | None = None
                        ) -> Iterator[EngineServerFront]:
    """Serve an EngineServerFront on a free loopback port; its `url` is the /v1 base."""
    front = EngineServerFront(upstream=upstream, model=model, refusals=list(refusals or []))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(front))
    server.daemon_threads = True
    front.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, name="engine-front", daemon=True)
    thread.start()
    try:
        yield front
    finally:
        server.shutdown()
        server.server_close()
