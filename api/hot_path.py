"""The two requests every job makes, answered in front of FastAPI's per-request machinery.

`POST /v1/jobs` and `GET /v1/jobs/{job_id}` (the long-poll) carry every job of the
service. Through FastAPI each costs ~100 us of the API's one event loop before and after
the route's own work (routing, ~15 dependency and middleware layers, parameter models;
measured in-process around a route that does nothing), against ~0.7 ms of API CPU per
submission in all; at thousands of jobs a second that loop is the API's ceiling.
`HotPath` is the app's outermost layer (`api.app.ServiceApp` calls it first) and answers
an ordinary request to either route itself, with the routes' own functions
(`api.routes.jobs.accept_job`, `job_response`), the same authentication and the same
exception handlers. It does for them what the app's middleware does for every other
request: the latency metric by route template, the body limit (by Content-Length), the
bounds on the JSON's depth and size (`core.json_bounds`), the last-resort 500.

Anything out of the ordinary goes on to FastAPI unchanged, which answers it as it always
has: a body without a Content-Length within the limit (chunked, or too large: FastAPI's
413), a body that is not a JSON object sent as `application/json` (another or no content
type, broken JSON, an array, JSON nested too deep: `api.json_guard` answers that), a
body that could not be read (a client gone), an empty or over-long Idempotency-Key, a
query other than one plain `wait=<seconds>`, a trailing slash. The rules are
`ordinary_submission` and `ordinary_read`.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import authenticate, bearer_scheme
from api.deps import MAX_IDEMPOTENCY_KEY_CHARS
from api.errors import internal_error_response, note_unexpected
from api.metrics import observe_request
from api.routes.jobs import accept_job, job_response, router
from core.json_bounds import json_bounds_error

JOBS_PATH = "/v1/jobs"
_JOB_PREFIX = JOBS_PATH + "/"
# What pydantic reads as a finite, non-negative float the same way: plain decimals only.
_PLAIN_WAIT = re.compile(r"wait=(\d{1,9}(?:\.\d{1,9})?)")
# How long a finding of whether FastAPI's telemetry is on holds (providers are configured
# at start-up; one configured later takes effect within this).
TRACED_CHECK_S = 1.0


class HotPath:
    """ASGI layer: ordinary job submissions and reads here, everything else on to `app`.

    `app` is the FastAPI app's own ASGI entry (its middleware stack), `api` the app whose
    state, exception handlers and telemetry settings apply, `max_body_bytes` the body
    limit of `/v1/jobs`.
    """

    def __init__(self, app: ASGIApp, *, api: FastAPI, max_body_bytes: int) -> None:
        self.app = app
        self.api = api
        self.max_body_bytes = max_body_bytes
        self._submit_route = _route(JOBS_PATH, "POST")
        self._read_route = _route(_JOB_PREFIX + "{job_id}", "GET")
        self._is_traced = False
        self._traced_until = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer an ordinary submission or read; pass anything else to the app."""
        if scope["type"] == "http" and not scope.get("root_path") and not self._traced():
            started = time.perf_counter()
            path = scope["path"]
            if path == JOBS_PATH and scope["method"] == "POST":
                await self._submit(scope, receive, send, started)
                return
            if path.startswith(_JOB_PREFIX) and scope["method"] == "GET":
                job_id = path[len(_JOB_PREFIX):]
                wait = ordinary_read(job_id, scope["query_string"])
                if wait is not None:
                    request = self._request(scope, receive, self._read_route)
                    await self._answer(request, send, self._read(request, job_id, wait),
                                       started)
                    return
        await self.app(scope, receive, send)

    def _traced(self) -> bool:
        """Whether FastAPI's own OpenTelemetry instrumentation is on (a provider is
        configured): then every request goes through FastAPI, which records its span.

        Asked once a TRACED_CHECK_S: each asking looks every provider up anew, ~3 us
        (timeit) and ~2% of the API's event loop's samples end to end (py-spy).
        """
        now = time.monotonic()
        if now >= self._traced_until:
            telemetry = getattr(self.api, "_native_telemetry", None)
            self._is_traced = telemetry is not None and telemetry.enabled()
            self._traced_until = now + TRACED_CHECK_S
        return self._is_traced

    def _request(self, scope: Scope, receive: Receive, route: APIRoute) -> Request:
        scope["app"] = self.api
        scope["route"] = route
        return Request(scope, receive)

    async def _submit(self, scope: Scope, receive: Receive, send: Send, started: float
                      ) -> None:
        request = Request(scope, receive)
        headers = request.headers
        declared = headers.get("content-length")
        if declared is None or not declared.isdigit() or int(declared) > self.max_body_bytes:
            await self.app(scope, receive, send)  # chunked, or FastAPI's 413
            return
        key = headers.get("idempotency-key")
        try:
            body = await request.body()
        except Exception as e:  # a client gone: FastAPI's to answer
            await self.app(scope, _raising(e), send)
            return
        raw = ordinary_submission(headers.get("content-type"), key, body)
        if raw is None:
            await self.app(scope, _replaying(body, receive), send)
            return
        request = self._request(scope, receive, self._submit_route)
        await self._answer(request, send, self._accept(request, raw, key), started)

    async def _accept(self, request: Request, raw: dict[str, Any], key: str | None
                      ) -> Response:
        tenant = await authenticate(request, await bearer_scheme(request))
        resources = self.api.state.resources
        return await accept_job(raw, tenant=tenant, idempotency_key=key, resources=resources,
                                producer=resources.producer)

    async def _read(self, request: Request, job_id: str, wait: float) -> Response:
        tenant = await authenticate(request, await bearer_scheme(request))
        return await job_response(self.api.state.resources, job_id=job_id, tenant=tenant,
                                  wait=wait)

    async def _answer(self, request: Request, send: Send, answering: Any, started: float
                      ) -> None:
        """Send what `answering` returns, or what the app's handler makes of its error.

        An error no handler takes is answered with the app's 500, counted and logged at
        most once a minute per error type (`api.errors.note_unexpected`), as
        `api.last_resort` does for every other route: never raised for the server to
        print a traceback per request.
        """
        status = 500
        try:
            try:
                response = await answering
            except Exception as e:
                response = await self._handler_for(e)(request, e)
            status = response.status_code
            await response(request.scope, request.receive, send)
        finally:
            observe_request(request.scope["method"], request.scope["route"].path, status,
                            time.perf_counter() - started)

    def _handler_for(self, error: Exception) -> Any:
        """The app's handler for `error`'s class, else its last-resort (`Exception`) one."""
        handlers = self.api.exception_handlers
        for cls in type(error).__mro__:
            if cls in handlers:
                return handlers[cls]
        return _unexpected


def ordinary_submission(content_type: str | None, idempotency_key: str | None,
                        body: bytes) -> dict[str, Any] | None:
    """The JSON object a submission carries, or None when FastAPI should judge it.

    Ordinary: `application/json` by its content type (FastAPI reads a body without one
    as bytes, and refuses it), an Idempotency-Key absent or of an accepted length, and a
    body that is a JSON object. It is parsed as FastAPI parses it (`json.loads`: orjson
    would read an integer past 64 bits as a float, and refuse NaN and lone surrogates).
    """
    if (content_type is None
            or content_type.partition(";")[0].strip().lower() != "application/json"):
        return None
    if idempotency_key is not None and not 0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY_CHARS:
        return None
    if json_bounds_error(body) is not None:
        return None  # FastAPI's layers answer it (`api.json_guard`'s 400)
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError, bytes in no encoding JSON has
        return None
    return raw if isinstance(raw, dict) else None


def ordinary_read(job_id: str, query_string: bytes) -> float | None:
    """The `wait` of a plain job read (0 without one), or None when FastAPI should judge it."""
    if not job_id or "/" in job_id:
        return None
    if not query_string:
        return 0.0
    found = _PLAIN_WAIT.fullmatch(query_string.decode("latin-1"))
    return float(found.group(1)) if found else None


def _route(path: str, method: str) -> APIRoute:
    """The jobs route for path and method: metrics label requests by its template."""
    for route in router.routes:
        if isinstance(route, APIRoute) and route.path == path and method in (route.methods or ()):
            return route
    raise LookupError(f"no {method} {path} route among the jobs routes")


async def _unexpected(request: Request, error: Exception) -> Response:
    """The 500 of an app without a handler for `Exception` (the service's has one)."""
    note_unexpected(error, method=request.method, route=request.scope["route"].path)
    return internal_error_response()


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the already-read body first, then the connection's own."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _raising(error: Exception) -> Receive:
    """A receive that fails as the connection's did, for FastAPI to meet it again."""

    async def fail() -> Message:
        raise error

    return fail
