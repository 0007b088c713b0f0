"""The exact-scan semantic cache in real Redis: scopes, other processes' writes, the
per-scope cap, expiry, and the bytes and evictions its ledger reports."""

from __future__ import annotations

import time
import uuid
from typing import Any, cast

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from storage.cache_ledger import LedgerReport
from storage.semantic_cache import SemanticEntry, SemanticMatch
from storage.semantic_exact import ExactSemanticCache

DIMS = 16


def units(seed: int, n: int) -> np.ndarray:
    """n random unit vectors."""
    rows = np.random.default_rng(seed).standard_normal((n, DIMS)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def entries(namespace: str, vectors: np.ndarray, first: int = 0,
            ttl_s: int = 60) -> list[SemanticEntry]:
    """One entry per vector: job j<i>, prompt p<i>, result {"i": i}."""
    return [SemanticEntry(namespace, f"j{first + i}", f"p{first + i}", v, {"i": first + i}, ttl_s)
            for i, v in enumerate(vectors)]


def held_bytes(client: redis.Redis, cache: ExactSemanticCache, scope: str) -> int:
    """What the ledger should say a scope holds: its vectors, metas and results, in Redis."""
    vec, meta, res, _ = cache.scope_keys(scope, DIMS)
    vectors = sum(len(chunk) for chunk in cast(list[bytes], client.lrange(vec, 0, -1)))
    metas = sum(len(m) for chunk in cast(list[bytes], client.lrange(meta, 0, -1))
                for m in chunk.split(b"\n"))
    return vectors + metas + sum(len(v) for v in cast(list[bytes], client.hvals(res)))


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    """A client of the test Redis."""
    return redis.Redis.from_url(redis_url)


def make_cache(client: redis.Redis, prefix: str, **kwargs: Any) -> ExactSemanticCache:
    """A cache as one process has it (its own mirrors)."""
    return ExactSemanticCache(client, prefix=prefix, **kwargs)


def test_a_scope_answers_its_own_near_prompts_only(client: redis.Redis) -> None:
    prefix, a, b = f"t{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, uuid.uuid4().hex
    vectors = units(1, 300)
    writer = make_cache(client, prefix)
    writer.add_many(entries(a, vectors))
    reader = make_cache(client, prefix)
    near = vectors[7] + 0.01 * units(2, 1)[0]
    match, far = reader.nearest_many(a, [near, -vectors[7]], min_similarity=0.9)
    assert match is not None and far is None
    assert (match.job_id, match.prompt, match.result) == ("j7", "p7", {"i": 7})
    assert match.similarity == pytest.approx(float(vectors[7] @ (near / np.linalg.norm(near))),
                                             abs=1e-5)
    assert reader.nearest(b, vectors[7]) is None
    # Entries another process adds later are seen on the next lookup.
    writer.add_many(entries(a, units(3, 5), first=300))
    assert reader.nearest(a, units(3, 5)[4]).job_id == "j304"  # type: ignore[union-attr]


def test_the_cap_drops_the_oldest_chunks_and_the_ledger_counts_them(
        client: redis.Redis) -> None:
    """Cap 16, chunks of 4: the 17th entry takes the scope over, ceil((17 - 15) / 4) = 1
    chunk (the oldest 4) goes; a reader synced before the trim follows it."""
    prefix, scope = f"t{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    vectors = units(4, 17)
    cache = make_cache(client, prefix, max_entries=16, per_chunk=4)
    reader = make_cache(client, prefix, max_entries=16, per_chunk=4)
    batch = entries(scope, vectors)
    for entry in batch[:16]:
        cache.add_many([entry])
    assert reader.nearest(scope, vectors[0]).job_id == "j0"  # type: ignore[union-attr]
    assert cache.ledger.sweep() == LedgerReport(held_bytes(client, cache, scope), 0)
    cache.add_many([batch[16]])
    assert cache.ledger.sweep() == LedgerReport(held_bytes(client, cache, scope), 0)
    assert client.hlen(cache.scope_keys(scope, DIMS)[2]) == 13
    assert client.hget(cache.ledger.keys[3], "evictions") == b"4"
    for i in range(4):  # gone from Redis and from the reader's mirror
        assert reader.nearest_many(scope, [vectors[i]], min_similarity=0.99) == [None]
    for i in (4, 16):
        assert reader.nearest(scope, vectors[i]).job_id == f"j{i}"  # type: ignore[union-attr]
    assert reader._mirrors.get(f"{scope}:{DIMS}").start == 4  # type: ignore[union-attr]


def test_expired_entries_miss_at_once_and_leave_the_head_in_whole_chunks(
        client: redis.Redis) -> None:
    prefix, scope = f"t{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    vectors = units(5, 9)
    cache = make_cache(client, prefix, max_entries=128, per_chunk=4)
    cache.add_many(entries(scope, vectors[:8], ttl_s=1))
    time.sleep(1.1)
    assert cache.nearest(scope, vectors[0]) is None  # expired, though still stored
    cache.add_many(entries(scope, vectors[8:], first=8, ttl_s=60))
    # Chunks [4][4][1]: both full head chunks had only expired entries.
    assert client.hget(cache.scope_keys(scope, DIMS)[3], "count") == b"1"
    assert cache.ledger.sweep().resident_bytes == held_bytes(client, cache, scope)
    assert client.hget(cache.ledger.keys[3], "evictions") == b"8"
    assert cache.nearest(scope, vectors[8]).job_id == "j8"  # type: ignore[union-attr]


def add_found_before_expiry(client: redis.Redis, cache: ExactSemanticCache, scope: str,
                            vectors: np.ndarray) -> SemanticMatch:
    """Add the vectors with a short TTL and find the last one before it runs out: 1 s,
    doubled (in a fresh incarnation) while this machine was slower than the TTL, so no
    speed of the machine fails the check, and a quick one waits for a short expiry."""
    for ttl_s in (1, 2, 4, 8, 16):
        cache.add_many(entries(scope, vectors, ttl_s=ttl_s))
        found = cache.nearest(scope, vectors[-1])
        if found is not None:
            return found
        # Not found: fine only if the scope's keys were (about to be) gone by then.
        left_ms = client.pttl(cache.scope_keys(scope, DIMS)[0])
        assert left_ms < 500, f"not found with {left_ms} ms of its TTL left"
        deadline = time.monotonic() + 60
        while client.exists(*cache.scope_keys(scope, DIMS)):
            assert time.monotonic() < deadline, "the scope never expired"
            time.sleep(0.05)
    raise AssertionError("the scope expired before its first read at every TTL up to 16 s")


def test_an_expired_scope_is_evicted_once_and_starts_over(client: redis.Redis) -> None:
    """Its keys expire together; the first sweep after counts its entries, the second
    nothing; a scope written again is a new incarnation, never mixed with the old mirror."""
    prefix, scope = f"t{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    cache = make_cache(client, prefix, per_chunk=4, max_entries=128)
    other = make_cache(client, prefix, per_chunk=4, max_entries=128)
    old = units(6, 6)
    found = add_found_before_expiry(client, cache, scope, old)
    assert found.job_id == "j5"
    deadline = time.monotonic() + 60
    while client.exists(*cache.scope_keys(scope, DIMS)):  # gone together with their TTL
        assert time.monotonic() < deadline, "the scope never expired"
        time.sleep(0.1)
    assert cache.ledger.sweep() == LedgerReport(0, 6)
    assert other.ledger.sweep() == LedgerReport(0, 0)
    new = units(7, 7)
    cache.add_many(entries(scope, new, first=100))
    assert cache.nearest_many(scope, [old[5]], min_similarity=0.99) == [None]
    assert cache.nearest(scope, new[6]).job_id == "j106"  # type: ignore[union-attr]
    assert len(cache._mirrors.get(f"{scope}:{DIMS}")) == 7  # type: ignore[arg-type]


def test_redis_down_is_a_miss_and_a_skipped_write() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    cache = make_cache(dead, "t")
    cache.add_many(entries("ab", units(8, 2)))
    assert cache.nearest_many("ab", list(units(8, 2))) == [None, None]
    with pytest.raises(ValueError, match="max_entries"):
        make_cache(dead, "t", max_entries=3, per_chunk=4)
