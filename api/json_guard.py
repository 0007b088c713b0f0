"""Request bodies bounded in depth and size before FastAPI parses them (400 otherwise).

FastAPI reads a JSON body with `json.loads`, which recurses once per nesting level: a
body nested ~1,000 deep raised RecursionError out of the parser, a plain-text 500 and a
traceback, before the API key was even looked at. This layer reads the body (already
bounded in bytes by `api.body_limit`), asks `core.json_bounds` about it and answers 400
in the error shape when it is too deep or holds too many values; otherwise the app gets
the same body, message for message. Multipart uploads stream past untouched (their
parser is not recursive and their files are not JSON to the API).
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import InvalidRequest
from core.json_bounds import json_bounds_error

# Methods whose body the routes read.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def too_complex(reason: str) -> InvalidRequest:
    """The 400 for a body over the bounds."""
    return InvalidRequest(f"We could not parse the JSON body of your request: {reason}.",
                          code="json_too_complex")


class JSONGuardMiddleware:
    """Refuses request bodies over `core.json_bounds`' limits before any parser runs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body, judge it, and replay it to the app (or answer 400)."""
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        content_type = Headers(scope=scope).get("content-type", "")
        if content_type.lower().startswith("multipart/"):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        failure: Exception | None = None
        try:
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request" or not message.get("more_body"):
                    break
        except Exception as e:  # the body limit's 413, a client gone: the app meets it
            failure = e
        if failure is None and messages and messages[-1]["type"] == "http.request":
            body = b"".join(m.get("body", b"") for m in messages)
            reason = json_bounds_error(body)
            if reason is not None:
                await too_complex(reason).to_response()(scope, receive, send)
                return
        await self.app(scope, _replaying(messages, failure, receive), send)


def _replaying(messages: list[Message], failure: Exception | None, receive: Receive
               ) -> Receive:
    """A receive that hands out `messages`, then raises `failure` or reads on."""
    num_replayed = 0

    async def replay() -> Message:
        nonlocal num_replayed
        if num_replayed < len(messages):
            num_replayed += 1
            return messages[num_replayed - 1]
        if failure is not None:
            raise failure
        return await receive()

    return replay
