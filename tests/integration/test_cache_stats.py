"""Per-worker cache counters in real Redis: published with a TTL, read back by worker."""

from __future__ import annotations

import random

import pytest
import redis

from storage.cache_stats import publish_cache_stats, read_cache_stats, stats_key


def test_workers_publish_and_the_reader_sees_each(redis_url: str) -> None:
    """Two workers' hashes come back apart; a republish replaces, never merges."""
    client = redis.Redis.from_url(redis_url)
    prefix = f"t{random.getrandbits(40):x}"
    publish_cache_stats(client, prefix=prefix, worker_id="w1", model="m", updated_at=1.0,
                        counters={"exact": {"hits": 3, "misses": 1},
                                  "kv": {"hits": 9, "resident_bytes": 100}}, ttl_s=15)
    publish_cache_stats(client, prefix=prefix, worker_id="w2", model="m", updated_at=2.0,
                        counters={"semantic": {"misses": 4}}, ttl_s=15)
    publish_cache_stats(client, prefix=prefix, worker_id="w2", model="m", updated_at=3.0,
                        counters={"semantic": {"misses": 5}}, ttl_s=15,
                        semantic_backend="exact")
    got = read_cache_stats(client, prefix=prefix)
    assert set(got) == {"w1", "w2"}
    assert got["w1"]["caches"]["exact"] == {"hits": 3, "misses": 1}
    assert got["w1"]["caches"]["kv"] == {"hits": 9, "resident_bytes": 100}
    assert got["w2"] == {"model": "m", "updated_at": 3.0, "semantic_backend": "exact",
                         "caches": {"exact": {}, "semantic": {"misses": 5}, "kv": {}}}
    assert got["w1"]["semantic_backend"] is None
    assert 0 < client.ttl(stats_key(prefix, "w1")) <= 15
    assert read_cache_stats(client, prefix=prefix + "x") == {}


def test_unknown_kinds_and_counters_are_refused(redis_url: str) -> None:
    """A typo in a kind or counter name is a ValueError naming the allowed ones."""
    client = redis.Redis.from_url(redis_url)
    with pytest.raises(ValueError, match="cache kinds"):
        publish_cache_stats(client, prefix="p", worker_id="w", model="m", updated_at=0.0,
                            counters={"prefix": {"hits": 1}}, ttl_s=5)
    with pytest.raises(ValueError, match="cache counters"):
        publish_cache_stats(client, prefix="p", worker_id="w", model="m", updated_at=0.0,
                            counters={"kv": {"hit": 1}}, ttl_s=5)
