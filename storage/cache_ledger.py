"""Bytes and evictions of a result cache (exact or semantic), kept in Redis beside it.

Responsible for: one ledger per cache kind that every worker updates in the round trip
of its cache writes, so `GET /v1/cache/stats` and the metrics can say how many bytes the
cache holds and how many entries left it. The ledger holds one *unit* per thing Redis
expires on its own: an exact result, a vector-search document, or a whole scope of the
fallback semantic cache (its keys expire together); each unit has its bytes, its number
of entries and the time its keys expire (the server's clock: `TIME` in the script).

What the figures mean:
- resident bytes: the value bytes of the units not known to be gone (a result's JSON; a
  semantic entry's vector, prompt JSON and result JSON), not Redis's own per-key overhead;
- an eviction: an entry that left the cache other than by being overwritten under the
  same key: dropped by the cache to keep a scope under its cap or because it expired at
  the head of its scope (the cache reports it with `drop`), or gone with its key's TTL,
  counted by the first sweep after its expiry time. An entry that Redis itself drops
  early (maxmemory) counts, and its bytes leave, only at its expiry time.
Every unit is removed by one atomic script call, so each eviction is counted once, by the
worker whose call removed it; their sum over workers is the cache's total.

Keys, all under one hash tag so that one script may touch them in Redis Cluster, and all
passed in KEYS:

    <prefix>:ledger:{<prefix>:<kind>}:expiry   zset unit → expiry (unix seconds)
    <prefix>:ledger:{<prefix>:<kind>}:bytes    hash unit → bytes
    <prefix>:ledger:{<prefix>:<kind>}:entries  hash unit → entries
    <prefix>:ledger:{<prefix>:<kind>}:totals   hash bytes, evictions (all workers)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import redis

logger = logging.getLogger(__name__)

# Expired units one call removes at most, so a backlog never holds Redis for long.
MAX_SWEPT_UNITS = 1000

# ARGV: max swept units, then (op, unit, bytes, entries, ttl seconds) per change.
# Ops: set (the unit is replaced), add (it grows; its expiry only moves later), drop
# (entries left it early: evicted). A unit found expired when touched is swept first.
_LEDGER_SCRIPT = """
local expiry, sizes, counts, totals = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local evicted = 0
local function incr(key, field, n)  -- integral, never '-0' or '1e+15'
  if n ~= 0 then return redis.call('HINCRBY', key, field, string.format('%d', n)) end
  return tonumber(redis.call('HGET', key, field) or '0')
end
local function forget(unit)
  local size = tonumber(redis.call('HGET', sizes, unit) or '0')
  local entries = tonumber(redis.call('HGET', counts, unit) or '0')
  incr(totals, 'bytes', -size)
  redis.call('HDEL', sizes, unit)
  redis.call('HDEL', counts, unit)
  redis.call('ZREM', expiry, unit)
  return entries
end
local function sweep_if_expired(unit)
  local at = redis.call('ZSCORE', expiry, unit)
  if at and tonumber(at) <= now then evicted = evicted + forget(unit) end
end
for i = 2, #ARGV, 5 do
  local op, unit = ARGV[i], ARGV[i + 1]
  local size, entries, ttl = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
  sweep_if_expired(unit)
  if op == 'set' then
    forget(unit)
    redis.call('HSET', sizes, unit, string.format('%d', size))
    redis.call('HSET', counts, unit, string.format('%d', entries))
    redis.call('ZADD', expiry, now + ttl, unit)
    incr(totals, 'bytes', size)
  elseif op == 'add' then
    incr(sizes, unit, size)
    incr(counts, unit, entries)
    redis.call('ZADD', expiry, 'GT', now + ttl, unit)
    incr(totals, 'bytes', size)
  elseif op == 'drop' and redis.call('ZSCORE', expiry, unit) then
    incr(sizes, unit, -size)
    incr(totals, 'bytes', -size)
    evicted = evicted + entries
    if incr(counts, unit, -entries) <= 0 then forget(unit) end
  end
end
for _, unit in ipairs(redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, ARGV[1])) do
  evicted = evicted + forget(unit)
end
incr(totals, 'evictions', evicted)
return {tonumber(redis.call('HGET', totals, 'bytes') or '0'), evicted}
"""

LedgerOp = Literal["set", "add", "drop"]


@dataclass(frozen=True, slots=True)
class LedgerChange:
    """One unit's change: replaced (`set`), grown (`add`) or shrunk by evictions (`drop`)."""

    op: LedgerOp
    unit: str
    num_bytes: int
    num_entries: int = 1
    ttl_s: int = 0


@dataclass(frozen=True, slots=True)
class LedgerReport:
    """The cache's resident bytes after a call, and the entries that call evicted."""

    resident_bytes: int
    num_evicted: int


class CacheLedger:
    """The bytes-and-evictions ledger of one cache kind (see the module docstring)."""

    def __init__(self, client: redis.Redis, *, prefix: str, kind: str) -> None:
        self.kind = kind
        tag = f"{prefix}:ledger:{{{prefix}:{kind}}}"
        self.keys = [f"{tag}:{name}" for name in ("expiry", "bytes", "entries", "totals")]
        self._script = client.register_script(_LEDGER_SCRIPT)
        self._client = client

    def queue(self, pipe: redis.client.Pipeline, changes: list[LedgerChange]) -> None:
        """Add the ledger call for `changes` to a pipeline (its reply: `report(...)`); run
        the pipeline with `storage.redis_scripts.execute`."""
        self._script(keys=self.keys, args=self._args(changes), client=pipe)

    def apply(self, changes: list[LedgerChange]) -> LedgerReport:
        """Record `changes` (and sweep) in a call of its own; RedisError propagates."""
        return self.report(self._script(keys=self.keys, args=self._args(changes)))

    def sweep(self) -> LedgerReport:
        """Remove units past their expiry; the resident bytes and what this call evicted."""
        return self.apply([])

    @staticmethod
    def report(reply: Any) -> LedgerReport:
        """A ledger call's reply read."""
        resident, evicted = reply
        return LedgerReport(max(0, int(resident)), int(evicted))

    @staticmethod
    def _args(changes: list[LedgerChange]) -> list[str | int]:
        args: list[str | int] = [MAX_SWEPT_UNITS]
        for change in changes:
            if change.op != "drop" and change.ttl_s < 1:
                raise ValueError(f"a ledger {change.op} needs ttl_s >= 1, got {change.ttl_s}")
            args += [change.op, change.unit, change.num_bytes, change.num_entries, change.ttl_s]
        return args
