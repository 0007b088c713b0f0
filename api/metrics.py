"""HTTP request metrics for the API, and the middleware that records them.

The job metrics every role shares live in `core.metrics`; this one only the API has. Like
them it is created at import, as prometheus_client requires (a second registration of a
name raises), and served by `GET /metrics` from the default registry.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Plain requests take milliseconds; long-polls and synchronous completions up to minutes.
HTTP_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
)  # fmt: skip

HTTP_REQUEST_SECONDS = Histogram(
    "batchinfer_http_request_seconds",
    "HTTP request latency at the API, by method, route template and status code.",
    ["method", "route", "status"],
    buckets=HTTP_LATENCY_BUCKETS_S,
)

UNEXPECTED_ERRORS = Counter(
    "batchinfer_http_unexpected_errors_total",
    "Exceptions no handler took (answered 500), by exception type.",
    ["error"],
)


def observe_request(method: str, route: str, status: int, seconds: float) -> None:
    """Count one request's latency under its method, route template and status."""
    _latency(method, route, status).observe(seconds)


@lru_cache(maxsize=1024)
def _latency(method: str, route: str, status: int) -> Any:
    # The series' child, looked up once: `labels()` costs ~2 us a request on the API's
    # event loop. Bounded, as clients choose the method.
    return HTTP_REQUEST_SECONDS.labels(method, route, str(status))


class HTTPMetricsMiddleware:
    """Observes every HTTP request's latency, labelled by its route template (not its URL)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Time the request; the route is known once the router has matched it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_note_status(message: Message) -> None:
            """Pass the message on, noting the response status as it goes by."""
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            # Templates, not paths: one series per route, not one per job id.
            route = getattr(scope.get("route"), "path", "unmatched")
            observe_request(scope["method"], route, status, time.perf_counter() - started)
