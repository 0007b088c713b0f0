"""The exact-result cache against a real Redis: hits, misses, expiry, outages."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import REGISTRY
from redis.backoff import NoBackoff
from redis.retry import Retry

from storage.cache_ledger import LedgerReport
from storage.result_cache import ResultCache, result_cache_key

BODY = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
RESULT = {"object": "text_completion", "choices": [{"text": " there", "index": 0}]}


@pytest.fixture
def cache(redis_url: str) -> Iterator[ResultCache]:
    """A cache under a prefix no other test uses."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield ResultCache(client, prefix=f"t{uuid.uuid4().hex[:10]}")
    finally:
        client.close()


def test_put_then_get_round_trips(cache: ResultCache) -> None:
    key = result_cache_key("m", BODY)
    assert cache.get(key) is None
    cache.put(key, RESULT, ttl=60)
    assert cache.get(key) == RESULT
    same = result_cache_key("m", {**BODY, "priority": "high", "temperature": 0.0})
    assert cache.get(same) == RESULT
    assert cache.get(result_cache_key("m", {**BODY, "max_tokens": 5})) is None


def test_results_round_trip_with_any_text_and_embedding_arrays(cache: ResultCache) -> None:
    """Non-Latin text, a lone surrogate (written by the standard library, which can) and a
    float32 vector (written as its shortest floats) come back as the stored JSON reads."""
    import numpy as np

    vector = np.array([0.1, -2.5e-8, 3.0], dtype=np.float32)
    entries = {
        "plain": {**RESULT, "choices": [{"text": "日本語 café 🚀"}]},
        "odd": {**RESULT, "choices": [{"text": "x\ud800y"}]},
        "vector": {"object": "list", "data": [{"embedding": vector}]},
    }
    keys = {name: result_cache_key("m", {**BODY, "prompt": name}) for name in entries}
    cache.put_many([(keys[name], value, 60) for name, value in entries.items()])
    assert cache.get(keys["plain"]) == entries["plain"]
    assert cache.get(keys["odd"]) == entries["odd"]
    assert cache.get(keys["vector"]) == {"object": "list", "data": [{"embedding": [0.1, -2.5e-8,
                                                                                    3.0]}]}


def test_entries_expire(cache: ResultCache) -> None:
    key = result_cache_key("m", BODY)
    cache.put(key, RESULT, ttl=1)
    assert cache.get(key) == RESULT
    time.sleep(1.3)
    assert cache.get(key) is None


def test_non_deterministic_requests_and_zero_ttl_are_never_stored(cache: ResultCache) -> None:
    sampled = result_cache_key("m", {**BODY, "temperature": 0.8})
    assert sampled is None
    cache.put(sampled, RESULT, ttl=60)
    assert cache.get(sampled) is None
    key = result_cache_key("m", BODY)
    cache.put(key, RESULT, ttl=0)
    assert cache.get(key) is None
    with pytest.raises(ValueError, match="ttl must be >= 0"):
        cache.put(key, RESULT, ttl=-1)


def _counted(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"kind": "exact", **labels}) or 0.0


def test_the_ledger_counts_bytes_held_and_each_expired_entry_once(cache: ResultCache) -> None:
    """Resident bytes are the JSON bytes of the live entries; overwriting a key is no
    eviction; an entry gone with its TTL is evicted once, by the first sweep after it."""
    size = len(json.dumps(RESULT, separators=(",", ":")))
    stored, loaded = _counted("batchinfer_cache_bytes_total", direction="stored"), \
        _counted("batchinfer_cache_bytes_total", direction="loaded")
    first, second = result_cache_key("m", BODY), result_cache_key("m", {**BODY, "seed": 3,
                                                                         "temperature": 1})
    brief = result_cache_key("m", {**BODY, "seed": 4, "temperature": 1})
    # A minute: nothing here may expire however slow the machine (the expiry is below).
    cache.put_many([(first, RESULT, 60), (second, RESULT, 60)])
    assert cache.ledger.sweep() == LedgerReport(2 * size, 0)
    bigger = {**RESULT, "usage": {"completion_tokens": 1}}
    cache.put(second, bigger, ttl=60)  # replaced, not evicted
    big = len(json.dumps(bigger, separators=(",", ":")))
    assert cache.ledger.sweep() == LedgerReport(size + big, 0)
    assert cache.get(second) == bigger
    assert _counted("batchinfer_cache_bytes_total", direction="stored") - stored == \
        2 * size + big
    assert _counted("batchinfer_cache_bytes_total", direction="loaded") - loaded == big
    # The expiry, on an entry of its own: gone with its one-second TTL, it is evicted by
    # the first sweep after it, once.
    cache.put(brief, RESULT, ttl=1)
    deadline = time.monotonic() + 60
    while cache.get(brief) is not None:
        assert time.monotonic() < deadline, "the brief entry never expired"
        time.sleep(0.05)
    assert cache.ledger.sweep() == LedgerReport(size + big, 1)
    assert cache.ledger.sweep() == LedgerReport(size + big, 0)
    cache.put(brief, RESULT, ttl=60)  # back again: a new entry, not a replacement
    assert cache.ledger.sweep() == LedgerReport(2 * size + big, 0)


def test_unreachable_redis_reads_as_a_miss() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    cache = ResultCache(dead, prefix="t")
    key = result_cache_key("m", BODY)
    errors = _counted("batchinfer_cache_errors_total")
    cache.put(key, RESULT, ttl=60)
    assert cache.get(key) is None
    assert _counted("batchinfer_cache_errors_total") - errors == 2
