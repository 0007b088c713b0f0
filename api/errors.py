"""The API's one error shape and the exception handlers that produce it.

Every error response, whatever raised it, has the body OpenAI clients expect:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature",
               "code": "invalid_value"}}

Responsible for: the `APIError` family that routes raise, turning validation errors into a
400 that names the offending field (as OpenAI and vLLM answer them), rendering Starlette's
HTTP errors (404 for unknown URLs, 405, 413 for oversized bodies), values the database
refuses (400) and dependency outages (database, Redis, broker → 503) in the same shape,
and a last-resort 500 that never leaks internals.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.exceptions
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kafka.errors import KafkaError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.metrics import UNEXPECTED_ERRORS
from core.error_log import ErrorLog
from core.request_checks import describe_errors, first_error
from core.request_checks import param_from_loc as param_from_loc
from core.requests import printable

logger = logging.getLogger(__name__)
# Unexpected errors: one traceback per type and route a minute, the rest counted.
unexpected_errors = ErrorLog(logger)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
RATE_LIMIT = "rate_limit_error"

# What a client should wait before retrying after a dependency outage, seconds.
UNAVAILABLE_RETRY_AFTER_S = 1


def error_body(
    message: str, *, type: str = INVALID_REQUEST, param: str | None = None,
    code: str | None = None,
) -> dict[str, dict[str, str | None]]:
    """The JSON body of every error response.

    Text that came from the client (a field name, a value) may hold a lone surrogate,
    which no UTF-8 encoder accepts; it is written as its escape (`\\ud800`) so the error
    about it can itself be sent.
    """
    return {"error": {"message": printable(message), "type": type,
                      "param": None if param is None else printable(param), "code": code}}


class APIError(Exception):
    """An error the client can act on; rendered with `status_code` and the error shape."""

    status_code = 400
    type = INVALID_REQUEST
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        status_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status_code is not None:
            self.status_code = status_code
            if status_code >= 500:
                self.type = SERVER_ERROR
        self.headers = headers or {}

    def to_response(self) -> JSONResponse:
        """This error as an HTTP response."""
        body = error_body(self.message, type=self.type, param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


class InvalidRequest(APIError):
    """400: well-formed JSON the service cannot honour (unsupported or inconsistent values)."""


class Unauthorized(APIError):
    """401: no API key, or one that is unknown or revoked."""

    status_code = 401
    code = "invalid_api_key"


class NotFound(APIError):
    """404: no such resource for this tenant (another tenant's job is not found either).

    The message names the id the client sent, cut to MAX_NOT_FOUND_MESSAGE characters in
    all: a path can carry kilobytes of it, which an answer need not echo.
    """

    status_code = 404
    code = "not_found"

    def __init__(self, message: str, **kwargs: Any) -> None:
        if len(message) > MAX_NOT_FOUND_MESSAGE:
            message = message[:MAX_NOT_FOUND_MESSAGE] + "..."
        super().__init__(message, **kwargs)


# Longest "not found" message (ids here are ~30 characters; the rest is its sentence).
MAX_NOT_FOUND_MESSAGE = 200


class InvalidParameter(APIError):
    """400: the body does not match the schema (missing, unknown, mistyped or out of range)."""

    status_code = 400
    code = "invalid_value"


class Conflict(APIError):
    """409: the request contradicts the resource's state (idempotency key reuse, ...)."""

    status_code = 409
    code = "conflict"


class RateLimited(APIError):
    """429: the tenant is over its request rate or active-job limit; retry after a while."""

    status_code = 429
    type = RATE_LIMIT
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None,
                 param: str | None = None) -> None:
        # Retry-After takes whole seconds; rounding down to 0 would invite a hot retry loop.
        seconds = max(1, int(retry_after_s + 0.999))
        super().__init__(message, code=code, param=param,
                         headers={"Retry-After": str(seconds)})


class ServiceUnavailable(APIError):
    """503: a dependency (database, broker, Redis) did not answer; nothing was written."""

    status_code = 503
    type = SERVER_ERROR
    code = "service_unavailable"

    def __init__(self, dependency: str, detail: str = "") -> None:
        message = f"The {dependency} is unavailable; retry shortly."
        if detail:
            message = f"{message} ({detail})"
        super().__init__(message, headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})
        self.dependency = dependency


class ServiceStopping(APIError):
    """503: the service was told to stop and takes no new job; nothing was written."""

    status_code = 503
    type = SERVER_ERROR
    code = "service_stopping"

    def __init__(self) -> None:
        super().__init__("The service is stopping and takes no new jobs; retry shortly.",
                         headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})


class Timeout(APIError):
    """504: the job did not finish within the synchronous request's time limit."""

    status_code = 504
    type = SERVER_ERROR
    code = "timeout"


def validation_error(errors: Sequence[Any]) -> APIError:
    """The client-facing error for pydantic's error list (the first field's problems).

    A bad header is a 400 naming the header; a body field that fails its schema, a 400
    naming the field (the rules are `core.request_checks.describe_errors`, which batch
    lines share).
    """
    if not errors:
        return InvalidParameter("Invalid request.")
    first = first_error(errors)
    loc = tuple(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "invalid JSON")
        return InvalidRequest(
            f"We could not parse the JSON body of your request ({detail}).", code="invalid_json"
        )
    param, message, code = describe_errors(errors)
    if param is None and loc[:1] == ("body",):
        return InvalidRequest(
            "The request body must be a JSON object; send it with "
            "Content-Type: application/json.",
            code="invalid_body",
        )
    if loc[:1] == ("header",):
        detail = "; ".join(str(e.get("msg")) for e in errors if tuple(e.get("loc", ()))[:2]
                           == loc[:2])
        return InvalidRequest(f"Invalid '{param}' header: {detail}.", param=param,
                              code="invalid_header")
    return InvalidParameter(message, param=param, code=code)


# FastAPI's own answer to a body it cannot decode (bytes that are not UTF-8 JSON).
_UNPARSABLE_BODY = "There was an error parsing the body"


def _http_error(status_code: int, detail: str, request: Request) -> APIError:
    if status_code == 400 and detail == _UNPARSABLE_BODY:
        return InvalidRequest("We could not parse the JSON body of your request (it is not "
                              "valid UTF-8 JSON).", code="invalid_json")
    if status_code == 404:
        return NotFound(
            f"Unknown request URL: {request.method} {request.url.path}.", code="unknown_url"
        )
    if status_code == 405:
        return APIError(f"Method {request.method} is not allowed on {request.url.path}.",
                        code="method_not_allowed", status_code=405)
    if status_code == 413:
        return APIError(detail or "The request body is too large.", code="request_too_large",
                        status_code=413)
    return APIError(detail, status_code=status_code)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.to_response()


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).to_response()


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    error = _http_error(exc.status_code, str(exc.detail), request)
    response = error.to_response()
    if exc.headers:
        response.headers.update(exc.headers)
    return response


def _unavailable_handler(
    name: str, dependency: str
) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    """A handler that logs `name` as down and answers 503 naming `dependency` to the client."""

    async def handler(request: Request, exc: Exception) -> JSONResponse:
        logger.warning("%s unavailable on %s %s: %s", name, request.method, request.url.path,
                       exc)
        return ServiceUnavailable(dependency).to_response()

    return handler


_database_handler = _unavailable_handler("database", "database")
_redis_handler = _unavailable_handler("redis", "cache (Redis)")
_broker_handler = _unavailable_handler("broker", "message broker")


async def _data_handler(request: Request, exc: Exception) -> JSONResponse:
    """400 for a value the database refuses to store or compare (PostgreSQL's text takes no
    NUL character; a number out of its column's range): the request's fault, not ours."""
    logger.warning("database refused a value on %s %s: %s", request.method, request.url.path,
                   exc)
    return InvalidRequest(
        "The request holds a value the database cannot take (such as a NUL character in "
        "an id or a number out of range); remove it and retry.", code="invalid_value",
    ).to_response()


def note_unexpected(error: BaseException, *, method: str, route: str) -> None:
    """Count an error no handler took; log its traceback unless one like it was just
    logged (`route` is the template, so a client cannot vary the key by URL)."""
    UNEXPECTED_ERRORS.labels(type(error).__name__).inc()
    unexpected_errors.exception(error, "unhandled error on %s %s", method, route,
                                place=f"{method} {route}")


def internal_error_response() -> JSONResponse:
    """The last-resort 500: the error shape, nothing of the error itself."""
    body = error_body("The server had an error while processing your request.",
                      type=SERVER_ERROR, code="internal_error")
    return JSONResponse(body, status_code=500)


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    route = getattr(request.scope.get("route"), "path", "unmatched")
    note_unexpected(exc, method=request.method, route=route)
    return internal_error_response()


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the API can meet to the one error shape."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    # OperationalError: connection refused, server gone, SQLite locked past its timeout.
    # TimeoutError: no pooled connection freed in time.
    app.add_exception_handler(sqlalchemy.exc.OperationalError, _database_handler)
    app.add_exception_handler(sqlalchemy.exc.TimeoutError, _database_handler)
    app.add_exception_handler(sqlalchemy.exc.DataError, _data_handler)
    app.add_exception_handler(redis.exceptions.ConnectionError, _redis_handler)
    app.add_exception_handler(redis.exceptions.TimeoutError, _redis_handler)
    app.add_exception_handler(KafkaError, _broker_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
