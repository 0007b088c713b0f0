"""The engine's KV tier in Redis, shared by every worker of one model revision.

Responsibilities:
- keep encoded prefix blocks (the engine's payloads: token ids + K/V of every layer in
  the pool's dtype) under `<prefix>:kv:{<model>:<revision>}:b:<chain hash>`; the chain hash
  is rooted in the request's cache salt, which the worker sets to the tenant, so one
  tenant's requests can never address another's blocks, and new weights never see old KV;
- a TTL per block and a byte budget per model revision, enforced by one Lua script per
  store: expired entries leave the byte count, then the oldest stored go until it fits
  (deleted by a second script: Redis Cluster safe, every key a script touches is passed
  in KEYS, and all of a revision's keys share one hash tag, `{<model>:<revision>}`);
- write on a background thread: the engine thread hands over the payloads and goes on
  with its step; a backlog beyond `MAX_PENDING_BYTES` is dropped (counted), never waited
  for; each script call carries at most `MAX_STORE_BYTES`, so Redis is never held long;
- count hits, misses, bytes and evictions for metrics and `GET /v1/cache/stats`;
- Redis down or slow: bypass the tier for a while with a warning and a metric; the
  engine then simply computes the prefix.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import cast

import redis

from core import metrics
from core.settings import Settings
from workers.engine import LLMEngine

logger = logging.getLogger(__name__)

# After a Redis error the tier is skipped this long, so a dead server costs one timeout
# per interval, not one per engine step.
BYPASS_AFTER_ERROR_S = 5.0
# Payload bytes waiting for the writer, at most; more is dropped rather than queued.
MAX_PENDING_BYTES = 256 << 20
# Payload bytes per store script call: a 1,000-token prefix of a 135M model in bf16 is
# ~23 MB, so a few calls, each short enough not to stall Redis for its other clients.
MAX_STORE_BYTES = 16 << 20

# Redis Cluster safe: every key a script touches is in KEYS and shares the namespace's
# hash tag, so one slot holds them all. Evicted blocks are therefore not deleted by the
# store script (the client could not have named them in advance): it returns their keys
# and `_DELETE_SCRIPT` deletes them next, with those keys in KEYS.
#
# KEYS: index (zset block key -> store time), sizes (hash block key -> bytes), total
# bytes, evictions, then the block keys to store. ARGV: now, ttl, budget, then one payload
# per block key, in the same order. Returns: bytes stored, evicted block keys.
_STORE_SCRIPT = """
local now, ttl, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local index, sizes, total, evictions = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local stored = 0
local function count(key, size)
  redis.call('HSET', sizes, key, size)
  redis.call('INCRBY', total, size)
end
local function forget(key)  -- off the books; the key itself expires or is deleted next
  redis.call('DECRBY', total, tonumber(redis.call('HGET', sizes, key) or '0'))
  redis.call('HDEL', sizes, key)
  redis.call('ZREM', index, key)
end
for i = 5, #KEYS do
  local key, payload = KEYS[i], ARGV[i - 1]
  if redis.call('SET', key, payload, 'EX', ttl, 'NX') then
    count(key, string.len(payload))
    stored = stored + string.len(payload)
  else
    if redis.call('HEXISTS', sizes, key) == 0 then  -- evicted, not yet deleted: books again
      count(key, redis.call('STRLEN', key))
    end
    redis.call('EXPIRE', key, ttl)
  end
  redis.call('ZADD', index, now, key)
end
for _, key in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now - ttl)) do
  forget(key)  -- stored ttl ago and not since: expired on its own
end
local evicted = {}
while tonumber(redis.call('GET', total) or '0') > budget do
  local oldest = redis.call('ZRANGE', index, 0, 0)
  if #oldest == 0 then break end
  forget(oldest[1])
  evicted[#evicted + 1] = oldest[1]
end
if #evicted > 0 then redis.call('INCRBY', evictions, #evicted) end
return {stored, evicted}
"""

# KEYS: index, then block keys a store evicted. One stored again since (back in the
# index) stays. Returns: keys deleted.
_DELETE_SCRIPT = """
local deleted = 0
for i = 2, #KEYS do
  if not redis.call('ZSCORE', KEYS[1], KEYS[i]) then
    deleted = deleted + redis.call('DEL', KEYS[i])
  end
end
return deleted
"""


@dataclass(slots=True)
class KVTierStats:
    """One worker's view of the tier: its own traffic, and the tier's shared size."""

    num_hits: int = 0  # blocks found
    num_misses: int = 0  # blocks asked for and not found
    num_stored_bytes: int = 0
    num_loaded_bytes: int = 0
    num_evictions: int = 0  # blocks this worker's stores pushed out of the budget
    num_errors: int = 0
    num_dropped_blocks: int = 0  # offered while the writer was too far behind


class RedisKVTier:
    """A `workers.engine.kv_tier.KVTier` on Redis (see the module docstring)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str,
        model: str,
        revision: str,
        ttl_s: int,
        max_bytes: int,
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"kv_tier_ttl_s must be >= 1 second, got {ttl_s}")
        if max_bytes < 1:
            raise ValueError(f"kv_tier_max_bytes must be >= 1, got {max_bytes}")
        self.client = client
        # The hash tag puts every key of the revision in one Redis Cluster slot.
        self.namespace = f"{prefix}:kv:{{{model}:{revision}}}"
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.stats = KVTierStats()
        self._keys = [f"{self.namespace}:{name}" for name in
                      ("index", "sizes", "bytes", "evictions")]  # fmt: skip
        self._store_script = client.register_script(_STORE_SCRIPT)
        self._delete_script = client.register_script(_DELETE_SCRIPT)
        self._bypass_until = 0.0
        self._lock = threading.Lock()  # stats are read by the publisher thread
        self._pending: queue.Queue[list[tuple[bytes, bytes]] | None] = queue.Queue()
        self._num_pending_bytes = 0
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer",
                                        daemon=True)  # fmt: skip
        self._writer.start()

    def close(self) -> None:
        """Write what is queued, stop the writer, close the client."""
        self._pending.put(None)
        self._writer.join()
        self.client.close()

    def wait_written(self) -> None:
        """Block until every block handed to `store` so far was written (or failed)."""
        self._pending.join()

    def block_key(self, block_hash: bytes) -> str:
        """The Redis key of one block."""
        return f"{self.namespace}:b:{block_hash.hex()}"

    def store(self, blocks: list[tuple[bytes, bytes]]) -> None:
        """Queue the blocks for the writer; dropped while Redis is bypassed or the queue full."""
        if not blocks or self._is_bypassed():
            return
        num_bytes = sum(len(payload) for _, payload in blocks)
        with self._lock:
            if self._num_pending_bytes + num_bytes > MAX_PENDING_BYTES:
                self.stats.num_dropped_blocks += len(blocks)
                metrics.KV_TIER_BLOCKS.labels("dropped").inc(len(blocks))
                logger.debug("KV tier writer behind; %d blocks dropped", len(blocks))
                return
            self._num_pending_bytes += num_bytes
        self._pending.put(blocks)

    def _write_loop(self) -> None:
        while True:
            blocks = self._pending.get()
            if blocks is None:
                self._pending.task_done()
                return
            try:
                # Blocks of one engine have one size: e.g. 16 MiB / 0.36 MB -> 46 per call.
                step = max(1, MAX_STORE_BYTES // max(1, len(blocks[0][1])))
                for start in range(0, len(blocks), step):
                    if self._is_bypassed():
                        break
                    self._write(blocks[start : start + step])
            except Exception:  # the writer must outlive a bug in one batch
                logger.exception("KV tier writer failed on %d blocks", len(blocks))
            finally:
                with self._lock:
                    self._num_pending_bytes -= sum(len(p) for _, p in blocks)
                self._pending.task_done()

    def _write(self, blocks: list[tuple[bytes, bytes]]) -> None:
        """One store script call: keep the blocks, enforce TTL and budget; then delete
        what the budget evicted."""
        keys = self._keys + [self.block_key(block_hash) for block_hash, _ in blocks]
        argv: list[bytes | str | int | float] = [time.time(), self.ttl_s, self.max_bytes]
        argv += [payload for _, payload in blocks]
        try:
            stored, evicted = self._store_script(keys=keys, args=argv)
        except redis.RedisError as e:
            self._failed("store", e)
            return
        with self._lock:
            self.stats.num_stored_bytes += int(stored)
            self.stats.num_evictions += len(evicted)
        metrics.KV_TIER_BYTES.labels("stored").inc(int(stored))
        metrics.KV_TIER_EVICTIONS.inc(len(evicted))
        if evicted:
            try:
                self._delete_script(keys=[self._keys[0], *evicted])
            except redis.RedisError as e:  # off the books already; they leave at their TTL
                self._failed("delete", e)

    def load(self, block_hashes: list[bytes]) -> list[bytes | None]:
        """The payloads found (one round trip); all misses while Redis is bypassed."""
        if not block_hashes:
            return []
        if self._is_bypassed():
            return [None] * len(block_hashes)
        try:
            keys = [self.block_key(h) for h in block_hashes]
            # A client without decode_responses (ours) answers bytes.
            found = cast(list[bytes | None], self.client.mget(keys))
        except redis.RedisError as e:
            self._failed("load", e)
            return [None] * len(block_hashes)
        # The engine uses the leading run only: blocks past the first miss count as misses.
        num_hits = next((i for i, p in enumerate(found) if p is None), len(found))
        loaded = sum(len(p) for p in found[:num_hits] if p is not None)
        with self._lock:
            self.stats.num_hits += num_hits
            self.stats.num_misses += len(found) - num_hits
            self.stats.num_loaded_bytes += loaded
        metrics.KV_TIER_BLOCKS.labels("hit").inc(num_hits)
        metrics.KV_TIER_BLOCKS.labels("miss").inc(len(found) - num_hits)
        metrics.KV_TIER_BYTES.labels("loaded").inc(loaded)
        metrics.CACHE_LOOKUPS.labels("kv", "hit" if num_hits else "miss").inc()
        return found[:num_hits] + [None] * (len(found) - num_hits)

    def resident_bytes(self) -> int | None:
        """Bytes the tier holds for this model revision (all workers), None if unknown."""
        try:
            value = self.client.get(self._keys[2])
        except redis.RedisError:
            return None
        return int(value or 0)

    def snapshot(self) -> KVTierStats:
        """A copy of this worker's counters."""
        with self._lock:
            return KVTierStats(**{f: getattr(self.stats, f) for f in KVTierStats.__slots__})

    def _is_bypassed(self) -> bool:
        return time.monotonic() < self._bypass_until

    def _failed(self, what: str, error: redis.RedisError) -> None:
        with self._lock:
            self.stats.num_errors += 1
        metrics.KV_TIER_ERRORS.inc()
        self._bypass_until = time.monotonic() + BYPASS_AFTER_ERROR_S
        logger.warning("KV tier %s failed (%s); bypassing Redis for %.0f s, prefixes are "
                       "computed meanwhile", what, error, BYPASS_AFTER_ERROR_S)  # fmt: skip


def connect_kv_tier(settings: Settings, engine: object, *, revision: str) -> RedisKVTier | None:
    """Attach a Redis KV tier to a generating engine when `kv_tier_enabled`; else None.

    The tier gets its own client with short timeouts (`kv_tier_timeout_s`): the engine
    thread waits on its loads, and a slow Redis must cost one bypass, not a stalled batch.
    The caller closes the tier (`close()`) once the engine has stopped.
    """
    if not settings.kv_tier_enabled:
        return None
    if not isinstance(engine, LLMEngine):
        logger.info("KV tier skipped: %s keeps no prefix KV", type(engine).__name__)
        return None
    client = redis.Redis.from_url(settings.kv_tier_redis_url or settings.redis_url,
                                  socket_timeout=settings.kv_tier_timeout_s,
                                  socket_connect_timeout=settings.kv_tier_timeout_s)  # fmt: skip
    # Workers of one revision may still differ in pool layout (dtype, block size): their
    # blocks live apart rather than refuse each other's payloads.
    runner = engine.runner
    layout = f"{str(runner.kv_dtype).removeprefix('torch.')}-bs{runner.block_size}"
    tier = RedisKVTier(client, prefix=settings.topic_prefix, model=settings.served_model_name,
                       revision=f"{revision}:{layout}", ttl_s=settings.kv_tier_ttl_s,
                       max_bytes=settings.kv_tier_max_bytes)  # fmt: skip
    engine.attach_kv_tier(tier, write_through=settings.kv_tier_write_through)
    logger.info("KV tier on: %s (ttl %d s, budget %d bytes%s)", tier.namespace,
                settings.kv_tier_ttl_s, settings.kv_tier_max_bytes,
                ", write-through" if settings.kv_tier_write_through else "")  # fmt: skip
    return tier
