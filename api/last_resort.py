"""The answer to an exception that no handler took: a 500 in the error shape, no flood.

Starlette's ServerErrorMiddleware renders the app's 500 handler and then raises the
exception again, so that the server prints its traceback: one traceback per request,
which any client that finds a crashing input can repeat at will. This layer sits just
inside it and ends such an exception: it answers the 500 (when nothing was sent yet),
counts it and logs it through `api.errors.note_unexpected` (one traceback per error
type and route a minute).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import internal_error_response, note_unexpected


class LastResortMiddleware:
    """Turns an unhandled exception into the shaped 500 instead of re-raising it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; an exception it lets out is answered and logged here."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        has_started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal has_started
            if message["type"] == "http.response.start":
                has_started = True
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as e:
            route = getattr(scope.get("route"), "path", "unmatched")
            note_unexpected(e, method=scope["method"], route=route)
            if not has_started:
                await internal_error_response()(scope, receive, send)
