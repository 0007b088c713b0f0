"""Per-job token streams in Redis: what a worker publishes as a job's text grows, and what
an API process reads back to relay it as Server-Sent Events.

Responsible for: the stream key and the follow channel (under the topic prefix), the
shape of an entry, publishing the entries of a step in one pipeline, reading entries
after a given id, and asking workers to stream a job that did not ask for it (`follow`).

Why a Redis Stream per job rather than pub/sub: a stream keeps what was published, so a
subscriber that arrives late (an SSE client that connects after the first tokens, a
relay that reconnects after a dropped Redis connection) reads the job's text from the
first entry on instead of missing it; pub/sub only delivers to whoever listens at that
moment. Each stream is bounded: XADD trims it to about `maxlen` entries and every write
renews a TTL, so a stream nobody reads disappears on its own.

An entry is one of:
- `{"e": "started"}`: the job entered an engine (a late follower learns it runs);
- `{"o": offset, "t": text}`: the job's text from character `offset` on grows by `text`.
  Offsets let a reader join text from entries it may see twice (a re-read after a
  reconnect) and notice one it never saw (trimmed by MAXLEN): it then waits for the
  stored result, whose text holds everything;
- `{"f": finish_reason}` (with or without text): the engine finished the job.
The database stays the source of truth: the result a relay ends with is the stored one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

logger = logging.getLogger(__name__)

STARTED = "started"


def token_stream_key(prefix: str, job_id: str) -> str:
    """The Redis Stream of one job's text deltas."""
    return f"{prefix}:jobs:tokens:{job_id}"


def follow_channel(prefix: str) -> str:
    """The channel on which API processes ask workers to stream a job (`publish_follow`)."""
    return f"{prefix}:jobs:follow"


@dataclass(slots=True)
class StreamEntry:
    """One entry of a job's token stream (see the module docstring)."""

    job_id: str
    offset: int | None = None  # with `text`: the character the text starts at
    text: str = ""
    finish_reason: str | None = None
    event: str | None = None  # STARTED

    def fields(self) -> dict[str, str | int]:
        """The entry as XADD fields."""
        fields: dict[str, str | int] = {}
        if self.event is not None:
            fields["e"] = self.event
        if self.offset is not None:
            fields["o"] = self.offset
            fields["t"] = self.text
        if self.finish_reason is not None:
            fields["f"] = self.finish_reason
        return fields

    @classmethod
    def parse(cls, job_id: str, fields: dict[Any, Any]) -> StreamEntry:
        """An entry from the fields XREAD returns (bytes or text); ValueError if malformed."""
        values = {_text(k): _text(v) for k, v in fields.items()}
        offset = values.get("o")
        if offset is not None and not offset.isdigit():
            raise ValueError(f"token stream entry with offset {offset!r}")
        return cls(job_id, offset=int(offset) if offset is not None else None,
                   text=values.get("t", ""), finish_reason=values.get("f"),
                   event=values.get("e"))


def publish_entries(redis_client: redis.Redis, entries: list[StreamEntry], *, prefix: str,
                    max_entries: int, ttl_s: int) -> None:
    """Append the entries to their jobs' streams in one round trip (no transaction).

    Each stream is trimmed to about `max_entries` (`~`: Redis trims whole nodes, which
    is far cheaper than an exact trim) and expires `ttl_s` after its last write.
    Raises redis.RedisError; the caller decides what a lost write costs.
    """
    if not entries:
        return
    pipe = redis_client.pipeline(transaction=False)
    renewed: set[str] = set()
    for entry in entries:
        key = token_stream_key(prefix, entry.job_id)
        pipe.xadd(key, entry.fields(), maxlen=max_entries, approximate=True)  # type: ignore[arg-type]
        if key not in renewed:
            pipe.expire(key, ttl_s)
            renewed.add(key)
    pipe.execute()


async def read_entries(aredis: aioredis.Redis, *, prefix: str, job_id: str, after_id: str,
                       block_ms: int) -> list[tuple[str, StreamEntry]]:
    """The job's entries after `after_id` ("0" for all), waiting up to `block_ms` for the
    first; (entry id, entry) pairs, malformed entries left out."""
    key = token_stream_key(prefix, job_id)
    reply: Any = await aredis.xread({key: after_id}, block=block_ms)
    found: list[tuple[str, StreamEntry]] = []
    for _stream, messages in reply or []:
        for entry_id, fields in messages:
            try:
                found.append((_text(entry_id), StreamEntry.parse(job_id, fields)))
            except ValueError as e:
                logger.warning("job %s: skipping a malformed token entry (%s)", job_id, e)
                found.append((_text(entry_id), StreamEntry(job_id)))  # keeps the position
    return found


async def publish_follow(aredis: aioredis.Redis, *, prefix: str, job_id: str) -> None:
    """Ask workers to stream a job that did not ask for it (best effort: a follower then
    gets the result without its deltas)."""
    try:
        await aredis.publish(follow_channel(prefix), job_id)
    except redis.RedisError as e:
        logger.warning("could not ask workers to stream job %s: %s", job_id, e)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
