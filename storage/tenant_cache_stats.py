"""One tenant's cache figures, read from its own jobs (`GET /v1/cache/stats` for tenants).

Workers publish service-wide counters (`storage.cache_stats`): every tenant's lookups,
other workers' figures. A tenant sees only what its own jobs say, over a recent window:
how many finished, how many were answered from the exact or the semantic result cache
(the `cached` marker of their results), and how many prompt tokens the prefix KV cache
served (`cached_tokens`, OpenAI's `prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from storage.models import Job
from storage.states import JobStatus


@dataclass(frozen=True, slots=True)
class TenantCacheCounts:
    """What a tenant's succeeded jobs since a time say about the caches."""

    num_jobs: int
    num_exact_hits: int
    num_semantic_hits: int
    num_prompt_tokens: int
    num_cached_tokens: int


def tenant_cache_counts(session: Session, *, tenant_id: str, since: datetime
                        ) -> TenantCacheCounts:
    """Counts over the tenant's jobs created since `since` that succeeded (one query, on
    the tenant/created_at index)."""
    marker = Job.result["cached"]
    is_exact = marker.as_string() == "exact"
    is_semantic = Job.result[("cached", "kind")].as_string() == "semantic"
    row = session.execute(
        select(
            func.count(Job.id),
            func.coalesce(func.sum(case((is_exact, 1), else_=0)), 0),
            func.coalesce(func.sum(case((is_semantic, 1), else_=0)), 0),
            func.coalesce(func.sum(Job.prompt_tokens), 0),
            func.coalesce(func.sum(Job.cached_tokens), 0),
        ).where(Job.tenant_id == tenant_id, Job.created_at >= since,
                Job.status == JobStatus.SUCCEEDED)
    ).one()
    return TenantCacheCounts(*(int(value or 0) for value in row))
