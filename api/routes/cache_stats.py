"""`GET /v1/cache/stats`: hits, misses, bytes and evictions per cache kind and per worker.

Workers publish their counters to Redis every `cache_stats_interval_s` (see
`storage.cache_stats`); this route adds them up. Kinds: `exact` and `semantic` (result
caches; lookups only: their entries leave by TTL, so nothing is evicted or budgeted) and
`kv` (the prefix KV tier: blocks found and missed, bytes moved, blocks pushed out of its
byte budget, and the bytes it holds per model revision). Counters are totals since each
listed worker started; a stopped worker drops out after a few intervals. Redis down
answers 503 like every other route that needs it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from api.deps import ResourcesDep, TenantDep
from api.resources import Resources
from storage.cache_stats import CACHE_KINDS, read_cache_stats

router = APIRouter(prefix="/v1/cache", tags=["cache"])


class CacheKindStats(BaseModel):
    """One cache kind's counters."""

    hits: int = 0
    misses: int = 0
    hit_rate: float | None = None  # hits / (hits + misses); None before any lookup
    stored_bytes: int = 0
    loaded_bytes: int = 0
    evictions: int = 0
    errors: int = 0
    resident_bytes: int | None = None  # kv only: what the tier holds now


class WorkerCacheStats(BaseModel):
    """One worker's counters, as it last published them."""

    worker_id: str
    model: str
    updated_at: float
    caches: dict[str, CacheKindStats]


class CacheStatsPublic(BaseModel):
    """Totals per kind over the live workers, then each worker."""

    object: str = "cache.stats"
    totals: dict[str, CacheKindStats]
    workers: list[WorkerCacheStats]


@router.get("/stats", response_model=CacheStatsPublic)
async def cache_stats(tenant: TenantDep, resources: ResourcesDep) -> CacheStatsPublic:
    """Cache counters of every live worker and their totals per cache kind."""
    published = await run_in_threadpool(_read, resources)
    workers = [
        WorkerCacheStats(worker_id=worker_id, model=entry["model"],
                         updated_at=entry["updated_at"],
                         caches={kind: _kind(entry["caches"].get(kind, {}), kind)
                                 for kind in CACHE_KINDS})
        for worker_id, entry in sorted(published.items())
    ]  # fmt: skip
    return CacheStatsPublic(totals=_totals(workers), workers=workers)


def _read(resources: Resources) -> dict[str, dict[str, Any]]:
    return read_cache_stats(resources.redis, prefix=resources.settings.topic_prefix)


def _kind(counters: dict[str, int], kind: str) -> CacheKindStats:
    stats = CacheKindStats(**{k: v for k, v in counters.items() if k != "resident_bytes"})
    if kind == "kv":
        stats.resident_bytes = counters.get("resident_bytes", 0)
    stats.hit_rate = _rate(stats.hits, stats.misses)
    return stats


def _totals(workers: list[WorkerCacheStats]) -> dict[str, CacheKindStats]:
    totals = {kind: CacheKindStats() for kind in CACHE_KINDS}
    # Workers of one model share one KV tier: count its resident bytes once per model.
    resident_by_model: dict[str, int] = {}
    for worker in workers:
        for kind, stats in worker.caches.items():
            total = totals[kind]
            total.hits += stats.hits
            total.misses += stats.misses
            total.stored_bytes += stats.stored_bytes
            total.loaded_bytes += stats.loaded_bytes
            total.evictions += stats.evictions
            total.errors += stats.errors
        kv = worker.caches["kv"].resident_bytes
        if kv is not None:
            resident_by_model[worker.model] = max(resident_by_model.get(worker.model, 0), kv)
    for total in totals.values():
        total.hit_rate = _rate(total.hits, total.misses)
    totals["kv"].resident_bytes = sum(resident_by_model.values())
    return totals


def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None
