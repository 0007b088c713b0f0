"""A loopback HTTP server that plays a webhook receiver in tests.

It records every request (headers, body, arrival time) and answers from a script: the
n-th request gets the n-th scripted reply, later ones the default reply (200). A reply
may sleep first, to play a slow receiver.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.utils.budget import within_budget


@dataclass(frozen=True)
class Reply:
    """What the receiver answers to one request."""

    status: int = 200
    body: bytes = b"ok"
    headers: dict[str, str] = field(default_factory=dict)
    sleep_s: float = 0.0


@dataclass(frozen=True)
class ReceivedRequest:
    """One request as the receiver saw it."""

    path: str
    headers: dict[str, str]
    body: bytes
    received_at: float


class WebhookReceiver:
    """Scripted replies and recorded requests, shared with the server's threads."""

    def __init__(self, script: list[Reply] | None = None, default: Reply | None = None) -> None:
        self.script = list(script or [])
        self.default = default or Reply()
        self.requests: list[ReceivedRequest] = []
        self.url = ""
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)

    def _next_reply(self, request: ReceivedRequest) -> Reply:
        with self._lock:
            index = len(self.requests)
            self.requests.append(request)
            self._arrived.notify_all()
            return self.script[index] if index < len(self.script) else self.default

    def wait_for(self, num_requests: int, timeout: float) -> list[ReceivedRequest]:
        """Block until `num_requests` arrived (AssertionError after `timeout`); all of them."""
        deadline = time.monotonic() + within_budget(timeout)
        with self._lock:
            while len(self.requests) < num_requests:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"receiver got {len(self.requests)} requests, expected {num_requests}"
                    )
                self._arrived.wait(left)
            return list(self.requests)


    def wait_for_header(self, name: str, value: str, timeout: float) -> list[ReceivedRequest]:
        """Block until a request whose header `name` (lower case) is `value` arrived
        (AssertionError after `timeout`); all requests so far."""
        deadline = time.monotonic() + within_budget(timeout)
        with self._lock:
            while not any(r.headers.get(name) == value for r in self.requests):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no request with {name}: {value} among "
                                         f"{len(self.requests)}")
                self._arrived.wait(left)
            return list(self.requests)

def _handler_for(receiver: WebhookReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            request = ReceivedRequest(
                path=self.path,
                headers={k.lower(): v for k, v in self.headers.items()},
                body=body,
                received_at=time.monotonic(),
            )
            reply = receiver._next_reply(request)
            if reply.sleep_s:
                time.sleep(reply.sleep_s)
            try:
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout test); nothing to answer

        def log_message(self, format: str, *args: object) -> None:
            return  # keep test output quiet

    return Handler


@contextmanager
def run_receiver(receiver: WebhookReceiver, path: str = "/hook") -> Iterator[WebhookReceiver]:
    """Serve `receiver` on 127.0.0.1 (a free port) while the block runs; sets its url."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(receiver))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
