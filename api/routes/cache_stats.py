"""`GET /v1/cache/stats`: hits, misses, bytes and evictions per cache kind and per worker.

Workers publish their counters to Redis every `cache_stats_interval_s` (see
`storage.cache_stats`); this route adds them up. Kinds:
- `exact` and `semantic` (result caches): lookups, bytes written (`stored_bytes`) and
  answered from (`loaded_bytes`), entries evicted (dropped for a scope's cap or at their
  expiry, each counted once: `storage.cache_ledger`), and `resident_bytes`, the value
  bytes the cache holds for all workers (the freshest worker's figure in the totals);
- `kv` (the prefix KV tier): blocks found and missed, bytes moved, blocks pushed out of
  its byte budget, and the bytes it holds per model revision.
`semantic_backend` says how semantic lookups search: `hnsw` (Redis vector search) or
`exact` (a numpy scan of the scope), per worker and overall (`mixed` while they differ).
Counters are totals since each listed worker started; a stopped worker drops out after a
few intervals. Redis down answers 503 like every other route that needs it.

Those are service-wide figures (every tenant's lookups, every worker): only keys of an
admin tenant (`admin_tenants`) see them, `scope: service`. Any other key sees its own
jobs' figures over the last day, `scope: tenant` (`storage.tenant_cache_stats`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from api.auth import CurrentTenant
from api.deps import ResourcesDep, TenantDep
from api.resources import Resources
from core.settings import Settings
from storage.cache_stats import CACHE_KINDS, read_cache_stats
from storage.models import utcnow
from storage.tenant_cache_stats import TenantCacheCounts, tenant_cache_counts

router = APIRouter(prefix="/v1/cache", tags=["cache"])

# A tenant's figures cover its jobs created this long ago at most.
TENANT_WINDOW_S = 86_400


class CacheKindStats(BaseModel):
    """One cache kind's counters."""

    hits: int = 0
    misses: int = 0
    hit_rate: float | None = None  # hits / (hits + misses); None before any lookup
    stored_bytes: int = 0
    loaded_bytes: int = 0
    evictions: int = 0
    errors: int = 0
    resident_bytes: int | None = None  # what the shared cache holds now


class WorkerCacheStats(BaseModel):
    """One worker's counters, as it last published them."""

    worker_id: str
    model: str
    updated_at: float
    semantic_backend: str | None = None  # hnsw or exact
    caches: dict[str, CacheKindStats]


class CacheStatsPublic(BaseModel):
    """Totals per kind over the live workers, then each worker."""

    object: str = "cache.stats"
    scope: str = "service"  # service (an admin key: every worker) or tenant (its own jobs)
    window_s: int | None = None  # a tenant's figures cover its jobs of this many seconds
    semantic_backend: str | None = None  # hnsw, exact, or mixed; None without workers
    totals: dict[str, CacheKindStats]
    workers: list[WorkerCacheStats]


@router.get("/stats", response_model=CacheStatsPublic)
async def cache_stats(tenant: TenantDep, resources: ResourcesDep) -> CacheStatsPublic:
    """For an admin tenant, cache counters of every live worker and their totals per cache
    kind; for any other, its own jobs' figures over the last TENANT_WINDOW_S."""
    if not is_admin(tenant, resources.settings):
        counts = await run_in_threadpool(_read_tenant, resources, tenant.id)
        return _tenant_view(counts)
    published = await run_in_threadpool(_read, resources)
    workers = [
        WorkerCacheStats(worker_id=worker_id, model=entry["model"],
                         updated_at=entry["updated_at"],
                         semantic_backend=entry.get("semantic_backend"),
                         caches={kind: _kind(entry["caches"].get(kind, {}), kind)
                                 for kind in CACHE_KINDS})
        for worker_id, entry in sorted(published.items())
    ]  # fmt: skip
    backends = {w.semantic_backend for w in workers if w.semantic_backend is not None}
    backend = backends.pop() if len(backends) == 1 else ("mixed" if backends else None)
    return CacheStatsPublic(semantic_backend=backend, totals=_totals(workers), workers=workers)


def is_admin(tenant: CurrentTenant, settings: Settings) -> bool:
    """Whether the tenant may see service-wide figures (`admin_tenants`, name or id)."""
    return tenant.name in settings.admin_tenants or tenant.id in settings.admin_tenants


def _read_tenant(resources: Resources, tenant_id: str) -> TenantCacheCounts:
    since = utcnow() - timedelta(seconds=TENANT_WINDOW_S)
    with resources.sessions() as session:
        return tenant_cache_counts(session, tenant_id=tenant_id, since=since)


def _tenant_view(counts: TenantCacheCounts) -> CacheStatsPublic:
    """A tenant's figures in the same shape: result-cache hits per kind, with every other
    finished job a miss of both; KV hits and misses in prompt tokens."""
    num_missed = counts.num_jobs - counts.num_exact_hits - counts.num_semantic_hits
    totals = {
        "exact": CacheKindStats(hits=counts.num_exact_hits, misses=num_missed),
        "semantic": CacheKindStats(hits=counts.num_semantic_hits, misses=num_missed),
        "kv": CacheKindStats(hits=counts.num_cached_tokens,
                             misses=counts.num_prompt_tokens - counts.num_cached_tokens),
    }
    for stats in totals.values():
        stats.hit_rate = _rate(stats.hits, stats.misses)
    return CacheStatsPublic(scope="tenant", window_s=TENANT_WINDOW_S, totals=totals,
                            workers=[])


def _read(resources: Resources) -> dict[str, dict[str, Any]]:
    return read_cache_stats(resources.redis, prefix=resources.settings.topic_prefix)


def _kind(counters: dict[str, int], kind: str) -> CacheKindStats:
    stats = CacheKindStats(**{k: v for k, v in counters.items() if k != "resident_bytes"})
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
    # The result caches are one per deployment: every worker reads the same figure.
    freshest = max(workers, key=lambda w: w.updated_at, default=None)
    for kind in ("exact", "semantic"):
        totals[kind].resident_bytes = 0 if freshest is None else \
            freshest.caches[kind].resident_bytes or 0
    return totals


def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None
