"""One call per key at a time on the event loop; whoever asks meanwhile shares its answer.

For reads that many requests in flight need at the same moment (an expired API key, a
tenant's active-job count): without it each of the 32 requests in flight ran its own
query on the thread pool, and all of them waited for the slowest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """Calls under way by key, shared by every caller of the same key until answered."""

    def __init__(self) -> None:
        self._pending: dict[str, asyncio.Future[T]] = {}

    def __len__(self) -> int:
        """Calls under way."""
        return len(self._pending)

    def start(self, key: str, call: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        """The call under way for `key`, started now if there is none; forgotten once done.

        A failure is retrieved here too, so a call nobody waits for (a refresh ahead of
        need, or one whose every waiter left) never warns that it went unretrieved.
        """
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(call())
            self._pending[key] = pending

            def settled(done: asyncio.Future[T]) -> None:
                if self._pending.get(key) is done:
                    del self._pending[key]
                if not done.cancelled():
                    done.exception()

            pending.add_done_callback(settled)
        return pending

    async def run(self, key: str, call: Callable[[], Awaitable[T]]) -> T:
        """The answer of the call under way for `key`, or of one started now."""
        # Shielded: a client that leaves cancels its own wait, not the others' call.
        return await asyncio.shield(self.start(key, call))
