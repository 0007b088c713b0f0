"""Publishes this worker's cache counters to Redis for `GET /v1/cache/stats`.

Responsible for: a background thread that, every `interval_s`, sweeps the exact and
semantic caches' ledgers (entries past their expiry leave and count as evictions:
`storage.cache_ledger`), gathers what this process counted of those caches (the
`batchinfer_cache_*` metrics: lookups, bytes, evictions, errors) and the KV tier's
counters, refreshes the resident-bytes gauges, and rewrites the worker's stats hash
(with the semantic cache's backend) with a TTL of three intervals. Redis trouble costs a
warning, never the worker.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from prometheus_client import REGISTRY

from core import metrics
from storage.cache_ledger import CacheLedger
from storage.cache_stats import publish_cache_stats
from workers.inference.kv_tier import RedisKVTier

logger = logging.getLogger(__name__)


RESULT_CACHE_KINDS = ("exact", "semantic")


def lookups_counted(kind: str) -> dict[str, int]:
    """Hits and misses of one result-cache kind that this process recorded."""
    counts = {}
    for outcome, name in (("hit", "hits"), ("miss", "misses")):
        value = REGISTRY.get_sample_value("batchinfer_cache_lookups_total",
                                          {"kind": kind, "outcome": outcome})  # fmt: skip
        counts[name] = int(value or 0)
    return counts


def result_cache_counted(kind: str) -> dict[str, int]:
    """Everything this process recorded of one result-cache kind (see the metrics)."""
    counts = lookups_counted(kind)
    for name, sample, labels in (
        ("stored_bytes", "batchinfer_cache_bytes_total", {"direction": "stored"}),
        ("loaded_bytes", "batchinfer_cache_bytes_total", {"direction": "loaded"}),
        ("evictions", "batchinfer_cache_evictions_total", {}),
        ("errors", "batchinfer_cache_errors_total", {}),
    ):
        counts[name] = int(REGISTRY.get_sample_value(sample, {"kind": kind, **labels}) or 0)
    return counts


class CacheStatsPublisher:
    """Background publisher of one worker's cache counters (see the module docstring)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str,
        worker_id: str,
        model: str,
        interval_s: float,
        kv_tier: RedisKVTier | None = None,
        semantic_backend: str | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"cache_stats_interval_s must be > 0, got {interval_s}")
        self.client = client
        self.prefix = prefix
        self.worker_id = worker_id
        self.model = model
        self.interval_s = interval_s
        self.kv_tier = kv_tier
        self.semantic_backend = semantic_backend
        self._ledgers = [CacheLedger(client, prefix=prefix, kind=k) for k in RESULT_CACHE_KINDS]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-stats", daemon=True)

    def __enter__(self) -> CacheStatsPublisher:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopping.set()
        self._thread.join(timeout=self.interval_s + 5.0)

    def publish(self) -> None:
        """Write the current counters once."""
        counters: dict[str, dict[str, int]] = {}
        for ledger in self._ledgers:
            report = ledger.sweep()
            metrics.CACHE_EVICTIONS.labels(ledger.kind).inc(report.num_evicted)
            metrics.CACHE_RESIDENT_BYTES.labels(ledger.kind).set(report.resident_bytes)
            counters[ledger.kind] = {**result_cache_counted(ledger.kind),
                                     "resident_bytes": report.resident_bytes}
        if self.kv_tier is not None:
            stats = self.kv_tier.snapshot()
            resident = self.kv_tier.resident_bytes()
            if resident is not None:
                metrics.KV_TIER_RESIDENT_BYTES.set(resident)
            counters["kv"] = {
                "hits": stats.num_hits, "misses": stats.num_misses,
                "stored_bytes": stats.num_stored_bytes, "loaded_bytes": stats.num_loaded_bytes,
                "evictions": stats.num_evictions, "errors": stats.num_errors,
                "resident_bytes": resident or 0,
            }  # fmt: skip
        publish_cache_stats(self.client, prefix=self.prefix, worker_id=self.worker_id,
                            model=self.model, updated_at=time.time(), counters=counters,
                            ttl_s=max(1, round(3 * self.interval_s)),
                            semantic_backend=self.semantic_backend)  # fmt: skip

    def _run(self) -> None:
        while True:
            try:
                self.publish()
            except redis.RedisError as e:
                logger.warning("cannot publish cache stats: %s", e)
            if self._stopping.wait(self.interval_s):
                return
