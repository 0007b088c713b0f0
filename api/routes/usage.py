"""`GET /v1/usage`: the tenant's finished jobs and tokens per model and day (UTC)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from api.deps import SessionDep, TenantDep
from api.errors import InvalidRequest
from api.job_filters import from_unix
from storage.job_queries import usage_by_day

router = APIRouter(prefix="/v1/usage", tags=["jobs"])

# Days `GET /v1/usage` covers when no `start` is given.
DEFAULT_DAYS = 30


class UsageBucket(BaseModel):
    """One model's finished jobs and tokens on one day."""

    date: str
    model: str
    num_jobs: int
    num_succeeded: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class UsagePublic(BaseModel):
    """Usage between `start` and `end` (Unix seconds), per model and day, oldest first."""

    object: str = "usage"
    start: int
    end: int
    data: list[UsageBucket]


@router.get("", response_model=UsagePublic)
def read_usage(
    tenant: TenantDep,
    session: SessionDep,
    start: Annotated[int | None, Query(
        ge=0, description=f"Unix time to count from (default {DEFAULT_DAYS} days ago).")] = None,
    end: Annotated[int | None, Query(ge=0, description="Unix time to count until (default now).")
                   ] = None,
) -> UsagePublic:
    """Jobs that finished in [start, end) and their tokens (prompt, completion, cached)."""
    until = from_unix(end) or datetime.now(UTC)
    since = from_unix(start) or until - timedelta(days=DEFAULT_DAYS)
    if since >= until:
        raise InvalidRequest("start must be before end", param="start", code="invalid_value")
    rows = usage_by_day(session, tenant_id=tenant.id, since=since, until=until)
    return UsagePublic(
        start=int(since.timestamp()), end=int(until.timestamp()),
        data=[UsageBucket(date=row.day.isoformat(), model=row.model, num_jobs=row.num_jobs,
                          num_succeeded=row.num_succeeded, prompt_tokens=row.prompt_tokens,
                          completion_tokens=row.completion_tokens,
                          cached_tokens=row.cached_tokens) for row in rows])
