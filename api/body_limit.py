"""Refuse request bodies over the size limit (413) before they are parsed.

Responsible for: the limit that applies to a path (`max_request_bytes`, or a larger one
for upload paths such as `/v1/files`), an immediate 413 when the declared Content-Length
is over it (the body is never read), and, for bodies without a Content-Length (chunked),
counting the bytes as the app reads them and failing the read once they pass the limit.
Both answers are in the API's one error shape.

(Starlette's own limiter answers a declared oversize with a plain-text body whatever the
exception handlers say, hence this middleware.)
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body


class BodyTooLarge(HTTPException):
    """Raised from `receive` when a streamed body passes the limit; rendered as a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=too_large_message(limit))


def too_large_message(limit: int) -> str:
    """What a client is told when its body is over `limit` bytes."""
    return f"The request body is too large; at most {limit} bytes are accepted."


class BodyLimitMiddleware:
    """Enforces `default_limit` bytes per request body, or a per-path-prefix limit."""

    def __init__(
        self, app: ASGIApp, *, default_limit: int, limits_by_prefix: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.default_limit = default_limit
        # Longest prefix first, so "/v1/files/x" matches "/v1/files" before "/v1".
        self.limits_by_prefix = sorted((limits_by_prefix or {}).items(),
                                       key=lambda item: len(item[0]), reverse=True)

    def limit_for(self, path: str) -> int:
        """The byte limit for a request to `path`."""
        for prefix, limit in self.limits_by_prefix:
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return limit
        return self.default_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer 413 at once for a declared oversize; otherwise count what is read."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            body = error_body(too_large_message(limit), code="request_too_large")
            # Close the connection: the unread body would otherwise be parsed as the
            # next request on it.
            response = JSONResponse(body, status_code=413, headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        num_received = 0

        async def receive_counted() -> Message:
            """The next body chunk; BodyTooLarge once the total passes the limit."""
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, receive_counted, send)
