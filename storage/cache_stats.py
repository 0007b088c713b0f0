"""Per-worker cache counters in Redis: workers publish, `GET /v1/cache/stats` reads.

Each worker keeps one small hash, `<prefix>:cache_stats:<worker id>`, rewritten every few
seconds with a TTL of a few intervals, so a worker that stopped drops out on its own.
Fields are `<kind>.<counter>` (kind: exact, semantic, kv; counter: hits, misses,
stored_bytes, loaded_bytes, evictions, errors, resident_bytes) plus `model`,
`updated_at` and `semantic_backend` (`hnsw` or `exact`); counters are totals since the
worker started, except `resident_bytes`, what the shared cache held when published.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import redis

logger = logging.getLogger(__name__)

CACHE_KINDS = ("exact", "semantic", "kv")
COUNTERS = ("hits", "misses", "stored_bytes", "loaded_bytes", "evictions", "errors",
            "resident_bytes")  # fmt: skip


def stats_key(prefix: str, worker_id: str) -> str:
    """The hash one worker publishes."""
    return f"{prefix}:cache_stats:{worker_id}"


def publish_cache_stats(
    client: redis.Redis,
    *,
    prefix: str,
    worker_id: str,
    model: str,
    updated_at: float,
    counters: Mapping[str, Mapping[str, int]],
    ttl_s: int,
    semantic_backend: str | None = None,
) -> None:
    """Replace the worker's hash with `counters` (kind → counter → value); one round trip."""
    unknown = [k for k in counters if k not in CACHE_KINDS]
    if unknown:
        raise ValueError(f"cache kinds must be among {CACHE_KINDS}, got {unknown}")
    fields: dict[str, str | int | float] = {"model": model, "updated_at": updated_at}
    if semantic_backend is not None:
        fields["semantic_backend"] = semantic_backend
    for kind, values in counters.items():
        for name, value in values.items():
            if name not in COUNTERS:
                raise ValueError(f"cache counters must be among {COUNTERS}, got {name!r}")
            fields[f"{kind}.{name}"] = int(value)
    key = stats_key(prefix, worker_id)
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    pipe.hset(key, mapping=fields)  # type: ignore[arg-type]  # stubs spell key types apart
    pipe.expire(key, ttl_s)
    pipe.execute()


def read_cache_stats(client: redis.Redis, *, prefix: str) -> dict[str, dict[str, Any]]:
    """Worker id → {"model", "updated_at", "semantic_backend", "caches": {kind: {counter:
    value}}}; `semantic_backend` is None for a worker that did not say."""
    match = stats_key(prefix, "*")
    keys = sorted(client.scan_iter(match=match, count=500))
    if not keys:
        return {}
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
    workers: dict[str, dict[str, Any]] = {}
    start = len(stats_key(prefix, ""))
    for key, raw in zip(keys, pipe.execute(), strict=True):
        if not raw:
            continue  # expired between the scan and the read
        fields = {_text(k): _text(v) for k, v in raw.items()}
        caches: dict[str, dict[str, int]] = {kind: {} for kind in CACHE_KINDS}
        for name, value in fields.items():
            kind, _, counter = name.partition(".")
            if kind in caches and counter in COUNTERS:
                caches[kind][counter] = int(value)
        workers[_text(key)[start:]] = {
            "model": fields.get("model", ""),
            "updated_at": float(fields.get("updated_at", 0.0)),
            "semantic_backend": fields.get("semantic_backend"),
            "caches": caches,
        }
    return workers


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
