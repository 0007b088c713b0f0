"""A request body must keep arriving: a client that stops mid-body gets a 408.

Why: uvicorn bounds idle keep-alive connections but not a body in progress. A client that
declared 1,000 bytes and sent 10 held its request, a worker of the event loop's attention
and the connection open for good, and a stop of the API waited for it ("Waiting for
connections to close"). Many such clients are the slowloris attack.

Responsible for: a `receive` that waits at most `seconds` for each chunk of a body still
being sent, and raises BodyReadTimeout (rendered as 408 in the API's error shape, with
`Connection: close`: the rest of the body must not be read as the next request). Once the
body is complete, `receive` waits without a bound again: a streaming response listens on
it for the client's disconnect for as long as it runs.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import Message, Receive


class BodyReadTimeout(HTTPException):
    """Raised from `receive` when a body chunk is later than the deadline."""

    def __init__(self, seconds: float) -> None:
        super().__init__(status_code=408, headers={"Connection": "close"},
                         detail=f"The request body stopped arriving: nothing came for "
                                f"{seconds:g} s before it was complete.")


def with_body_deadline(receive: Receive, seconds: float) -> Receive:
    """`receive`, with each body chunk due within `seconds` until the body is complete."""
    is_complete = False

    async def receive_in_time() -> Message:
        nonlocal is_complete
        if is_complete:
            return await receive()
        try:
            # A timer on this task, not wait_for's task per chunk: the hot path reads
            # thousands of bodies a second.
            async with asyncio.timeout(seconds):
                message = await receive()
        except TimeoutError:
            raise BodyReadTimeout(seconds) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            is_complete = True
        return message

    return receive_in_time
