"""The semantic cache on any Redis: vectors kept per scope, searched exactly with numpy.

Responsible for: storing answered prompts per scope (vector, prompt, result) with one
script call per scope, keeping each scope at most `max_entries` long (the oldest go) and
dropping expired entries from its head, mirroring each searched scope in this process
(`storage.semantic_mirror`) and bringing the mirror up to date with one script call per
lookup, scoring a poll's queries of a scope in one pass over its vectors (float16 where
the process runs torch, the few best rescored exactly: `storage.semantic_scan`), and
keeping the cache's ledger (`storage.cache_ledger`): bytes held, entries evicted.

Layout, per scope `s` = `<namespace>:<dims>` (one hash tag, so each script's keys share
a Redis Cluster slot; every key is passed in KEYS):

    <prefix>:sem:{s}:vec   list of chunks: each the float32 unit vectors of up to
                           `per_chunk` entries back to back, oldest first
    <prefix>:sem:{s}:meta  list of chunks, the same entries' {"job_id", "prompt",
                           "expires_at"} JSON joined by newlines (JSON has none)
    <prefix>:sem:{s}:res   hash job_id → result JSON
    <prefix>:sem:{s}:head  hash epoch (this incarnation of the scope), base (entries ever
                           trimmed from the head: the absolute index of the first held),
                           count (entries held), vb (bytes per vector), per_chunk

Chunks, not one element per entry: reading 100,000 list elements costs Redis and the
client seconds, 800 chunks of 128 vectors a fraction of one. Reads never pass bulk data
through Lua (slow for megabytes): a lookup reads the head hash (HMGET), and only when
entries were added or trimmed since, the new chunks in a MULTI with the head again, to
check that no trim moved the chunks between the two. Every chunk but the last is
full, so absolute entry a sits in chunk (a - base) // per_chunk; trims drop whole chunks
from the head. Worked example, per_chunk 4, base 8, chunks [4][4][2]: entry 17 is chunk
(17 - 8) // 4 = 2, offset 1; the scope holds 10 entries, the next is entry 18.

A scope's keys expire together, each write extending them to its entry's TTL if that is
later; an entry also carries its own expiry, checked on a hit. Cost per lookup: one
round trip (nothing new: five small fields come back), one pass over the n ≤
`max_entries` vectors of the scope (float16 in a worker: half the bytes of float32) and
an exact rescoring of the few that may win, and one HMGET for the results picked.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from typing import Any, cast

import numpy as np
import redis

from core import metrics
from storage import redis_scripts
from storage.cache_ledger import CacheLedger, LedgerChange
from storage.semantic_cache import (
    KIND,
    NUM_CANDIDATES,
    SemanticEntry,
    SemanticMatch,
    count_failed_write,
    count_write,
    from_json_bytes,
    json_bytes,
    unit_vector,
)
from storage.semantic_mirror import MirrorSet, ScopeMirror
from storage.semantic_scan import RowScorer

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 100_000  # per scope
DEFAULT_MAX_MIRROR_BYTES = 1 << 30  # per process, all scopes
DEFAULT_PER_CHUNK = 128  # entries per chunk: 192 KiB of 384-d vectors
# Head chunks one write looks at for expired entries, at most.
MAX_EXPIRED_CHUNKS = 4
# Chunks one read returns at most (~24 MiB of 384-d vectors at 128 per chunk): a cold
# mirror of a large scope loads in several round trips, none holding Redis long.
MAX_CHUNKS_PER_READ = 128
# Reads retried at most when a trim moved the scope's head between their two steps.
MAX_READ_TRIES = 4

# KEYS: vec, meta, res, head. ARGV: now, ttl ms, max entries, trim to, per chunk and
# epoch (both if new), then (vector, meta, job id, result) per entry. Over the cap, whole
# head chunks go until at most `trim to` entries are left; else head chunks whose every
# entry expired. Returns: epoch, base, entries held, entries dropped, their bytes.
_ADD_SCRIPT = r"""
local vec, meta, res, head = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, ttl_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local cap, trim_to = tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('HSETNX', head, 'epoch', ARGV[6])
redis.call('HSETNX', head, 'per_chunk', ARGV[5])
redis.call('HSETNX', head, 'vb', string.len(ARGV[7]))
local per_chunk = tonumber(redis.call('HGET', head, 'per_chunk'))
local vb = tonumber(redis.call('HGET', head, 'vb'))
local i = 7
local function take(limit)  -- the next entries, at most `limit`: vectors, metas
  local vs, ms = {}, {}
  while #vs < limit and i <= #ARGV do
    vs[#vs + 1] = ARGV[i]
    ms[#ms + 1] = ARGV[i + 1]
    redis.call('HSET', res, ARGV[i + 2], ARGV[i + 3])
    i = i + 4
  end
  return table.concat(vs), table.concat(ms, '\n')
end
if redis.call('LLEN', vec) > 0 then
  local last = redis.call('LINDEX', vec, -1)
  local room = per_chunk - string.len(last) / vb
  if room > 0 then
    local vs, ms = take(room)
    redis.call('LSET', vec, -1, last .. vs)
    redis.call('LSET', meta, -1, redis.call('LINDEX', meta, -1) .. '\n' .. ms)
  end
end
while i <= #ARGV do
  local vs, ms = take(per_chunk)
  redis.call('RPUSH', vec, vs)
  redis.call('RPUSH', meta, ms)
end
local num_chunks = redis.call('LLEN', vec)
local length = redis.call('HINCRBY', head, 'count', (#ARGV - 6) / 4)
local drop_chunks = 0
if length > cap then
  drop_chunks = math.min(num_chunks - 1, math.ceil((length - trim_to) / per_chunk))
else
  while drop_chunks < math.min(num_chunks - 1, MAX_EXPIRED_CHUNKS) do
    local live = false
    for m in string.gmatch(redis.call('LINDEX', meta, drop_chunks), '[^\n]+') do
      if cjson.decode(m)['expires_at'] >= now then live = true break end
    end
    if live then break end
    drop_chunks = drop_chunks + 1
  end
end
local dropped, dropped_bytes = 0, 0
if drop_chunks > 0 then
  for _, chunk in ipairs(redis.call('LRANGE', meta, 0, drop_chunks - 1)) do
    for m in string.gmatch(chunk, '[^\n]+') do
      local job_id = cjson.decode(m)['job_id']
      dropped = dropped + 1
      dropped_bytes = dropped_bytes + vb + string.len(m) + redis.call('HSTRLEN', res, job_id)
      redis.call('HDEL', res, job_id)
    end
  end
  redis.call('LTRIM', vec, drop_chunks, -1)
  redis.call('LTRIM', meta, drop_chunks, -1)
  redis.call('HINCRBY', head, 'base', dropped)
  redis.call('HINCRBY', head, 'count', -dropped)
end
for _, key in ipairs(KEYS) do
  if redis.call('PTTL', key) < ttl_ms then redis.call('PEXPIRE', key, ttl_ms) end
end
local h = redis.call('HMGET', head, 'epoch', 'base')
return {h[1], tonumber(h[2] or '0'), length - dropped, dropped, dropped_bytes}
""".replace("MAX_EXPIRED_CHUNKS", str(MAX_EXPIRED_CHUNKS))

class ExactSemanticCache:
    """The `exact` semantic-cache backend (see the module docstring)."""

    backend = "exact"

    def __init__(self, client: redis.Redis, *, prefix: str,
                 max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_mirror_bytes: int = DEFAULT_MAX_MIRROR_BYTES,
                 per_chunk: int = DEFAULT_PER_CHUNK,
                 scorer: RowScorer | None = None) -> None:
        """`scorer`: how lookups scan (default: `RowScorer.for_process()`); every scorer
        serves the same answers, only the time differs."""
        if per_chunk < 1:
            raise ValueError(f"per_chunk must be >= 1, got {per_chunk}")
        if max_entries < per_chunk:
            raise ValueError(f"semantic_cache_max_entries must be >= {per_chunk} (a chunk), "
                             f"got {max_entries}")
        self._redis = client
        self._prefix = prefix
        self.max_entries = max_entries
        self.per_chunk = per_chunk
        # Over the cap, a sixteenth more goes: trims (and the ledger's second call) come
        # in batches, not once per write at a full scope.
        self._trim_to = max_entries - max_entries // 16
        self.ledger = CacheLedger(client, prefix=prefix, kind=KIND)
        self._add = client.register_script(_ADD_SCRIPT)
        self._mirrors = MirrorSet(max_mirror_bytes)
        self._lock = threading.Lock()
        self.scorer = scorer or RowScorer.for_process()

    def scope_keys(self, namespace: str, dims: int) -> list[str]:
        """vec, meta, res and head keys of a scope."""
        tag = f"{self._prefix}:sem:{{{namespace}:{dims}}}"
        return [f"{tag}:{part}" for part in ("vec", "meta", "res", "head")]

    def add_many(self, entries: list[SemanticEntry]) -> None:
        """Remember answered prompts: one script call per scope, in one round trip."""
        by_scope: dict[tuple[str, int], list[SemanticEntry]] = defaultdict(list)
        for entry in entries:
            if entry.ttl_s > 0:
                by_scope[(entry.namespace, int(np.asarray(entry.vector).size))].append(entry)
        if not by_scope:
            return
        now = time.time()
        pipe = self._redis.pipeline(transaction=False)
        changes = []
        for (namespace, dims), group in by_scope.items():
            ttl_s = max(e.ttl_s for e in group)
            args: list[bytes | str | int | float] = [
                now, ttl_s * 1000, self.max_entries, self._trim_to, self.per_chunk,
                os.urandom(8).hex()]
            num_bytes = 0
            for e in group:
                meta = json_bytes({"job_id": e.job_id, "prompt": e.prompt,
                                   "expires_at": now + e.ttl_s})
                vector, result = unit_vector(e.vector).tobytes(), json_bytes(e.result)
                num_bytes += len(vector) + len(meta) + len(result)
                args += [vector, meta, e.job_id, result]
            self._add(keys=self.scope_keys(namespace, dims), args=args, client=pipe)
            changes.append(LedgerChange("add", f"{namespace}:{dims}", num_bytes, len(group),
                                        ttl_s))
        self.ledger.queue(pipe, changes)
        try:
            replies = redis_scripts.execute(pipe)
            drops = [LedgerChange("drop", change.unit, int(reply[4]), int(reply[3]))
                     for change, reply in zip(changes, replies, strict=False) if int(reply[3])]
            reports = [self.ledger.report(replies[-1])]
            if drops:  # rare: a scope reached its cap, or a batch of its head expired
                reports.append(self.ledger.apply(drops))
        except redis.RedisError as e:
            count_failed_write(e, len(entries))
            return
        count_write(sum(c.num_bytes for c in changes), reports)

    def nearest_many(self, namespace: str, vectors: list[np.ndarray],
                     min_similarity: float = -1.0) -> list[SemanticMatch | None]:
        """Per vector, the most similar live earlier prompt of the scope, or None; results
        are fetched only for matches at least `min_similarity` alike."""
        if not vectors:
            return []
        misses: list[SemanticMatch | None] = [None] * len(vectors)
        queries = np.stack([unit_vector(v) for v in vectors])
        dims = queries.shape[1]
        try:
            with self._lock:
                mirror = self._synced(namespace, dims)
                if mirror is None or not len(mirror):
                    return misses
                picks = self._picks(mirror, queries, min_similarity)
            if not picks:
                return misses
            raws = self._redis.hmget(self.scope_keys(namespace, dims)[2],
                                     [meta["job_id"] for _, meta, _ in picks])
        except (redis.RedisError, ValueError) as e:  # ValueError: a scope's chunks disagree
            metrics.CACHE_ERRORS.labels(KIND).inc()
            logger.warning("semantic cache read failed (%s); treating as a miss", e)
            return misses
        matches = misses
        for (query, meta, similarity), raw in zip(picks, raws, strict=True):
            if raw is not None:  # None: trimmed since the mirror was read
                metrics.CACHE_BYTES.labels(KIND, "loaded").inc(len(raw))
                matches[query] = SemanticMatch(meta["job_id"], meta["prompt"], similarity,
                                               from_json_bytes(raw))
        return matches

    def nearest(self, namespace: str, vector: np.ndarray) -> SemanticMatch | None:
        """`nearest_many` for one vector."""
        return self.nearest_many(namespace, [vector])[0]

    def _picks(self, mirror: ScopeMirror, queries: np.ndarray,
               min_similarity: float) -> list[tuple[int, dict[str, Any], float]]:
        """(query index, meta, similarity) of each query's best live candidate."""
        now = time.time()
        picks = []
        for query, ranked in enumerate(mirror.best_rows(queries, NUM_CANDIDATES,
                                                        min_similarity, self.scorer)):
            for row, similarity in ranked:
                meta = mirror.meta(row)
                if meta["expires_at"] >= now:
                    picks.append((query, meta, similarity))
                    break
        return picks

    def _synced(self, namespace: str, dims: int) -> ScopeMirror | None:
        """The scope's mirror brought up to date (caller holds the lock); None if empty."""
        scope = f"{namespace}:{dims}"
        vec, meta, _, head = self.scope_keys(namespace, dims)
        mirror = self._mirrors.get(scope)
        num_races = 0
        while True:
            # A client without decode_responses (ours) answers bytes.
            fields = cast(list[bytes | None],
                          self._redis.hmget(head, ["epoch", "base", "count", "per_chunk"]))
            if fields[0] is None:
                self._mirrors.discard(scope)
                return None
            epoch = fields[0]
            base, count, per_chunk = (int(f or 0) for f in fields[1:])
            if mirror is None or epoch != mirror.epoch or not base <= mirror.end <= base + count:
                # A new incarnation of the scope, or one trimmed past all this mirror held.
                mirror = ScopeMirror(epoch, base, dims, half=self.scorer.half)
                mirror.reserve(count)
            elif base > mirror.start:
                mirror.drop_head(base - mirror.start)
            if mirror.end == base + count:
                break
            # Absolute entry mirror.end is in chunk (end - base) // per_chunk, `skip` in.
            first, skip = divmod(mirror.end - base, per_chunk)
            pipe = self._redis.pipeline(transaction=True)
            pipe.hmget(head, ["epoch", "base"])
            pipe.lrange(vec, first, first + MAX_CHUNKS_PER_READ - 1)
            pipe.lrange(meta, first, first + MAX_CHUNKS_PER_READ - 1)
            now_head, vector_chunks, meta_chunks = pipe.execute()
            if now_head != fields[:2] or not vector_chunks:
                num_races += 1  # trimmed or restarted in between: read the head again
                if num_races > MAX_READ_TRIES:
                    logger.warning("semantic cache scope %s kept changing while read; "
                                   "searching the entries read so far", scope)
                    break
                continue
            mirror.append_chunks(vector_chunks, meta_chunks, skip=skip)
        if mirror is not None:
            self._mirrors.put(scope, mirror)
        return mirror
