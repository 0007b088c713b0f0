"""A tenant's jobs as lists and counts: the filters of `GET /v1/jobs`.

Filters combine with AND; `metadata` matches each given key's string value exactly. Every
query starts from the tenant's rows, so one tenant never counts another's jobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from storage.jobs import MAX_LIST_LIMIT, get_job
from storage.models import Job, JobStatus
from storage.pages import keyset_page


@dataclass(frozen=True, slots=True)
class JobFilter:
    """Which of a tenant's jobs a list or count takes; None (or empty) takes all."""

    status: JobStatus | None = None
    batch_id: str | None = None
    model: str | None = None
    priority: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    created_after: datetime | None = None  # inclusive
    created_before: datetime | None = None  # exclusive

    def apply(self, query: Select[Any]) -> Select[Any]:
        """`query` narrowed to the jobs this filter takes."""
        for column, value in ((Job.status, self.status), (Job.batch_id, self.batch_id),
                              (Job.model, self.model), (Job.priority, self.priority)):
            if value is not None:
                query = query.where(column == value)
        for key, value in self.metadata.items():
            query = query.where(Job.metadata_[key].as_string() == value)
        if self.created_after is not None:
            query = query.where(Job.created_at >= self.created_after)
        if self.created_before is not None:
            query = query.where(Job.created_at < self.created_before)
        return query


def list_jobs_where(session: Session, *, tenant_id: str, where: JobFilter, limit: int = 20,
                    after: str | None = None) -> tuple[list[Job], bool, int]:
    """A page of the tenant's jobs that `where` takes, newest first; whether more follow;
    how many it takes in all."""
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}")
    after_key = None
    if after is not None:
        cursor = get_job(session, job_id=after, tenant_id=tenant_id)
        if cursor is None:
            raise ValueError(f"unknown cursor {after!r}: pass the id of a job from the last page")
        after_key = (cursor.created_at, cursor.id)
    query = where.apply(select(Job).where(Job.tenant_id == tenant_id))
    jobs, has_more = keyset_page(session, query, created_at=Job.created_at, id=Job.id,
                                 after=after_key, limit=limit)
    total = session.scalar(where.apply(
        select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id)))
    return jobs, has_more, int(total or 0)
