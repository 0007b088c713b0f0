"""CachePolicy: what each `cache.mode` lets a request read, fill and share."""

from __future__ import annotations

from storage.cache_policy import DEFAULT_MAX_ERROR, CachePolicy


def test_off_bypasses_every_cache_and_the_other_modes_share_prefix_kv() -> None:
    """`off` reads, fills and shares nothing; every other mode keeps the prefix KV caches."""
    off = CachePolicy.of({"cache": {"mode": "off"}})
    assert (off.reads_exact, off.reads_semantic, off.fills, off.shares_prefix_kv) == (
        False, False, False, False)  # fmt: skip
    for mode in ("auto", "exact", "semantic"):
        assert CachePolicy.of({"cache": {"mode": mode}}).shares_prefix_kv
    assert CachePolicy.of({}).shares_prefix_kv


def test_odd_fields_from_the_queue_read_as_defaults() -> None:
    """A body from the queue is read leniently: unknown mode, bool ttl, string threshold."""
    policy = CachePolicy.of({"cache": {"mode": "sometimes", "ttl": True, "threshold": "x"}})
    assert policy == CachePolicy("auto", None, None, DEFAULT_MAX_ERROR)
    assert CachePolicy.of({"cache": {"ttl": 30}}).ttl_or(5) == 30
    assert CachePolicy.of({"cache": {"max_error": 7}}).max_error == DEFAULT_MAX_ERROR


def test_max_error_and_threshold_are_read_from_the_body() -> None:
    policy = CachePolicy.of({"cache": {"mode": "semantic", "max_error": 0.05}})
    assert (policy.max_error, policy.threshold) == (0.05, None)
    assert CachePolicy.of({"cache": {"mode": "semantic", "threshold": 0.97}}).threshold == 0.97
