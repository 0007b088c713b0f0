"""Best-effort Redis writes of several owners, sent in one round trip.

Responsible for: gathering the commands of independent writers (the result cache's
entries and ledger, a completion announcement, the token budgets' settling) in one
pipeline, sending it once, and handing each writer its own replies, or the error that
stopped them, so that each keeps the failure handling it had as a call of its own.

Why: a worker that stores an engine step's results told Redis three things after the
commit, one round trip each: fill the result cache, announce the finished jobs, settle
their token reservations. With 1-token jobs that was ~15% of the worker's time; one
round trip carries all three.

What stays as it was: commands run in the order they were added; Redis runs a
pipeline's commands one by one and an error reply stops none of the others, so one
writer's failure (an error reply) leaves the others' writes done, as separate calls
did; a Lua script in the pipeline is still atomic by itself. Only a lost connection
fails every writer at once, as it would have failed each of their calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from storage import redis_scripts

# A writer's replies, in the order of its commands, or the first error among them.
Outcome = list[Any] | redis.RedisError
# What it returns is ignored (a pipeline command answers the pipeline itself).
Queue = Callable[[redis.client.Pipeline], object]
Done = Callable[[Outcome], None]


@dataclass(slots=True)
class _Part:
    start: int
    end: int
    done: Done


class RedisBatch:
    """One pipeline shared by several writers (see the module docstring)."""

    def __init__(self, client: redis.Redis) -> None:
        self._pipe = client.pipeline(transaction=False)
        self._parts: list[_Part] = []

    def add(self, queue: Queue, done: Done) -> None:
        """Let `queue` add a writer's commands; `done` hears their outcome at `execute`."""
        start = len(self._pipe.command_stack)
        queue(self._pipe)
        self._parts.append(_Part(start, len(self._pipe.command_stack), done))

    @property
    def num_commands(self) -> int:
        """Commands added so far."""
        return len(self._pipe.command_stack)

    def execute(self) -> None:
        """Send every writer's commands in one round trip, then tell each its outcome."""
        parts, self._parts = self._parts, []
        if not self._pipe.command_stack:
            for part in parts:
                part.done([])
            return
        try:
            replies = redis_scripts.execute(self._pipe, raise_on_error=False)
        except redis.RedisError as e:
            for part in parts:
                part.done(e)
            return
        for part in parts:
            own = replies[part.start:part.end]
            error = next((r for r in own if isinstance(r, redis.RedisError)), None)
            part.done(own if error is None else error)
