"""`GET /v1/usage`: finished jobs and tokens, grouped by model, day (UTC) and tenant.

A tenant sees its own jobs. An admin tenant (`admin_tenants`) may ask for `scope=service`:
every tenant's jobs, optionally one tenant's (`tenant`, a name or id), and may group by
`tenant`. `totals` sums the groups; both come from the stored job rows, so they equal the
sum of the jobs' own usage exactly.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel

from api.deps import ResourcesDep, SessionDep, TenantDep
from api.errors import InvalidRequest, NotFound
from api.job_filters import MAX_UNIX_TIME, from_unix
from api.routes.cache_stats import is_admin
from storage.models import Tenant
from storage.tenants import tenant_by_name
from storage.usage import UsageSum, parse_group_by, usage_summary

router = APIRouter(prefix="/v1/usage", tags=["jobs"])

# Days `GET /v1/usage` covers when no `start` is given.
DEFAULT_DAYS = 30


class UsageBucket(BaseModel):
    """One group's finished jobs and tokens (a key not grouped by is null)."""

    date: str | None = None
    model: str | None = None
    tenant_id: str | None = None
    num_jobs: int
    num_succeeded: int
    num_errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int


class UsagePublic(BaseModel):
    """Usage between `start` and `end` (Unix seconds) per group, in key order, and totals."""

    object: str = "usage"
    scope: str = "tenant"
    start: int
    end: int
    group_by: list[str]
    data: list[UsageBucket]
    totals: UsageBucket


@router.get("", response_model=UsagePublic)
def read_usage(
    tenant: TenantDep,
    session: SessionDep,
    resources: ResourcesDep,
    start: Annotated[int | None, Query(
        ge=0, le=MAX_UNIX_TIME,
        description=f"Unix time to count from (default {DEFAULT_DAYS} days ago).")] = None,
    end: Annotated[int | None, Query(
        ge=0, le=MAX_UNIX_TIME, description="Unix time to count until (default now).")] = None,
    group_by: Annotated[str, Query(
        description="Comma-separated: model, day, tenant (tenant: scope=service only).")
    ] = "model,day",
    scope: Annotated[Literal["tenant", "service"], Query(
        description="tenant (own jobs) or service (every tenant's; admin keys only).")
    ] = "tenant",
    tenant_ref: Annotated[str | None, Query(
        alias="tenant", description="With scope=service: only this tenant (name or id).")
    ] = None,
) -> UsagePublic:
    """Jobs that finished in [start, end) and their tokens (prompt, completion, cached)."""
    until = from_unix(end) or datetime.now(UTC)
    since = from_unix(start) or until - timedelta(days=DEFAULT_DAYS)
    if since >= until:
        raise InvalidRequest("start must be before end", param="start", code="invalid_value")
    try:
        keys = parse_group_by(group_by)
    except ValueError as e:
        raise InvalidRequest(str(e), param="group_by", code="invalid_value") from e
    tenant_id: str | None = tenant.id
    if scope == "service":
        if not is_admin(tenant, resources.settings):
            raise InvalidRequest("scope=service is for admin tenants' keys "
                                 "(BATCHINFER_ADMIN_TENANTS)", param="scope",
                                 code="not_admin", status_code=403)
        tenant_id = None if tenant_ref is None else _tenant_id(session, tenant_ref)
    elif tenant_ref is not None or "tenant" in keys:
        raise InvalidRequest("tenant (as a filter or in group_by) needs scope=service",
                             param="tenant" if tenant_ref is not None else "group_by",
                             code="invalid_value")
    sums = usage_summary(session, tenant_id=tenant_id, since=since, until=until,
                         group_by=keys)
    return UsagePublic(scope=scope, start=int(since.timestamp()), end=int(until.timestamp()),
                       group_by=list(keys), data=[_bucket(s) for s in sums],
                       totals=_totals(sums))


def _tenant_id(session: SessionDep, ref: str) -> str:
    found = session.get(Tenant, ref) or tenant_by_name(session, name=ref)
    if found is None:
        raise NotFound(f"no tenant named or with id {ref!r}")
    return found.id


def _bucket(s: UsageSum) -> UsageBucket:
    return UsageBucket(date=None if s.day is None else s.day.isoformat(), model=s.model,
                       tenant_id=s.tenant_id, num_jobs=s.num_jobs,
                       num_succeeded=s.num_succeeded, num_errors=s.num_errors,
                       prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens,
                       cached_tokens=s.cached_tokens, total_tokens=s.total_tokens)


def _totals(sums: list[UsageSum]) -> UsageBucket:
    fields = ("num_jobs", "num_succeeded", "num_errors", "prompt_tokens",
              "completion_tokens", "cached_tokens", "total_tokens")
    return UsageBucket(**{f: sum(getattr(s, f) for s in sums) for f in fields})
