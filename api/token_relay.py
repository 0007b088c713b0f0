"""Following one job from the API: its text as a worker publishes it, then its result.

Responsible for: reading the job's token stream (`storage.token_streams`) from its first
entry on, so a follower that arrives late still gets the whole text; joining entries by
their offsets into text deltas that never repeat nor skip; waiting for the job's end
through the process's done hub at the same time (`api.job_state.wait_for_job`); and
ending with the stored view, whose result's text makes up for whatever the stream did
not carry (a cached answer, a trimmed or unreadable stream, the last step's entry still
on its way).

The events are `Started`, `TextDelta`, `Idle` (nothing for IDLE_S: a caller may send a
keep-alive) and, last, `Finished` with the job's view (terminal, or as it stands when
`timeout_s` ran out).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis

from api.job_state import wait_for_job
from api.resources import Resources
from api.schemas import JobPublic
from api.stream_chunks import result_calls, result_text
from storage.token_streams import STARTED, StreamEntry, read_entries

logger = logging.getLogger(__name__)

# How long one XREAD blocks in Redis: the relay's reads cost nothing while it waits, and
# an idle follower hears of itself this often.
READ_BLOCK_MS = 1_000
# A follower told nothing for this long gets an `Idle` event.
IDLE_S = 10.0


@dataclass(frozen=True, slots=True)
class Started:
    """The job entered an engine."""


@dataclass(frozen=True, slots=True)
class TextDelta:
    """The job's text grew by `text`."""

    text: str


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing happened for IDLE_S."""


@dataclass(frozen=True, slots=True)
class Finished:
    """The job's view: terminal, or as it stands when the follow's time ran out."""

    view: JobPublic


Event = Started | TextDelta | Idle | Finished


class _Text:
    """The text relayed so far, joined from offset entries (see storage.token_streams)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.num_chars = 0
        self.has_gap = False

    def add(self, entry: StreamEntry) -> str:
        """What `entry` adds to the text relayed so far ("" if nothing, or after a gap)."""
        if entry.offset is None or self.has_gap:
            return ""
        if entry.offset > self.num_chars:
            # An entry was trimmed or lost: the stored result fills in at the end.
            self.has_gap = True
            return ""
        new = entry.text[self.num_chars - entry.offset:]
        if new:
            self.parts.append(new)
            self.num_chars += len(new)
        return new

    def rest_of(self, final: str) -> str:
        """What the final text adds to the text relayed so far."""
        sent = "".join(self.parts)
        if not final.startswith(sent):
            # A job run again after its worker died, sampling other tokens: what was
            # relayed cannot be taken back.
            logger.warning("a relayed job's stored text does not continue what was relayed")
            return ""
        return final[len(sent):]


async def follow_job(resources: Resources, *, job_id: str, tenant_id: str,
                     timeout_s: float) -> AsyncIterator[Event]:
    """The job's events until it ends or `timeout_s` passes (module docstring)."""
    prefix = resources.settings.topic_prefix
    done = asyncio.ensure_future(wait_for_job(resources, job_id=job_id, tenant_id=tenant_id,
                                              timeout=timeout_s))
    read: asyncio.Future[list[tuple[str, StreamEntry]]] | None = None
    text, last_id, is_started, can_read = _Text(), "0", False, True
    told_at = time.monotonic()
    try:
        while True:
            if read is None and can_read:
                read = asyncio.ensure_future(read_entries(
                    resources.aredis, prefix=prefix, job_id=job_id, after_id=last_id,
                    block_ms=READ_BLOCK_MS))
            waiting: set[asyncio.Future[object]] = {done}  # type: ignore[arg-type]
            if read is not None:
                waiting.add(read)  # type: ignore[arg-type]
            await asyncio.wait(waiting, timeout=IDLE_S, return_when=asyncio.FIRST_COMPLETED)
            if read is not None and read.done():
                entries, read = _entries_of(read, job_id), None
                if entries is None:
                    can_read = False  # Redis is away: the result will carry the text
                    entries = []
                for entry_id, entry in entries:
                    last_id = entry_id
                    new = text.add(entry)
                    if not is_started and (entry.event == STARTED or new):
                        is_started = True
                        told_at = time.monotonic()
                        yield Started()
                    if new:
                        told_at = time.monotonic()
                        yield TextDelta(new)
            if done.done():
                view = done.result()
                if view is None:
                    raise LookupError(f"job {job_id} is gone")
                # A result of tool calls has no text to continue the relayed one with: that
                # text was the calls (api.tool_call_stream sends them from the result).
                if (view.status.is_terminal and view.result is not None
                        and not result_calls(view.result)):
                    rest = text.rest_of(result_text(view.result))
                    if rest:
                        yield TextDelta(rest)
                yield Finished(view)
                return
            if time.monotonic() - told_at >= IDLE_S:
                told_at = time.monotonic()
                yield Idle()
    finally:
        for future in (read, done):
            if future is not None and not future.done():
                future.cancel()


def _entries_of(read: asyncio.Future[list[tuple[str, StreamEntry]]],
                job_id: str) -> list[tuple[str, StreamEntry]] | None:
    """A finished read's entries; None when Redis failed it."""
    try:
        return read.result()
    except (redis.RedisError, OSError) as e:
        logger.warning("job %s: cannot read its tokens from Redis (%s); relaying its result "
                       "when it ends", job_id, e)
        return None

