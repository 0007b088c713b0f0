"""What tenants used: finished jobs and their tokens, summed by model, day and tenant.

One GROUP BY over the finished jobs of a window (by `finished_at`, UTC); `tenant_id` None
sums every tenant's (the admin view). The figures are those stored on the job rows, so
they equal the sum of the jobs' own `usage` exactly: prompt tokens (all of them, cached
ones included), completion tokens (0 for an answer from the result cache), and cached
tokens (prompt tokens served from the prefix cache, or the whole prompt of a cached
answer as stored with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from storage.models import Job, JobStatus

# What usage can be grouped by, in the order columns come out.
GROUP_KEYS = ("tenant", "model", "day")


@dataclass(frozen=True, slots=True)
class UsageSum:
    """Finished jobs and tokens of one group (a key not grouped by is None)."""

    tenant_id: str | None
    model: str | None
    day: date | None
    num_jobs: int
    num_succeeded: int
    num_errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


def parse_group_by(text: str) -> tuple[str, ...]:
    """`model,day` → ("model", "day"); ValueError naming an unknown key."""
    keys = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    unknown = [k for k in keys if k not in GROUP_KEYS]
    if unknown:
        raise ValueError(f"cannot group usage by {', '.join(unknown)}; "
                         f"group_by takes {', '.join(GROUP_KEYS)}, comma-separated")
    return keys


def usage_summary(session: Session, *, tenant_id: str | None, since: datetime,
                  until: datetime, group_by: tuple[str, ...]) -> list[UsageSum]:
    """Jobs that finished in [since, until), summed per group, in key order."""
    day = func.date(Job.finished_at)
    columns: dict[str, Any] = {"tenant": Job.tenant_id, "model": Job.model, "day": day}
    keys = [columns[k] for k in GROUP_KEYS if k in group_by]
    query = (
        select(*keys, func.count(),
               func.sum(case((Job.status == JobStatus.SUCCEEDED, 1), else_=0)),
               func.sum(case((Job.status == JobStatus.FAILED, 1), else_=0)),
               func.coalesce(func.sum(Job.prompt_tokens), 0),
               func.coalesce(func.sum(Job.completion_tokens), 0),
               func.coalesce(func.sum(Job.cached_tokens), 0))
        .where(Job.finished_at >= since, Job.finished_at < until)
    )  # fmt: skip
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    if keys:
        query = query.group_by(*keys).order_by(*keys)
    sums = []
    for row in session.execute(query):
        values = dict(zip([k for k in GROUP_KEYS if k in group_by], row[:len(keys)],
                          strict=True))
        n, ok, errors, p, c, k = row[len(keys):]
        if not n:
            continue  # no job in the window: the ungrouped query still answers one row
        sums.append(UsageSum(
            tenant_id=values.get("tenant"), model=values.get("model"),
            day=_as_date(values["day"]) if "day" in values else None,
            num_jobs=int(n), num_succeeded=int(ok or 0), num_errors=int(errors or 0),
            prompt_tokens=int(p), completion_tokens=int(c), cached_tokens=int(k)))
    return sums


def _as_date(value: Any) -> date:
    # SQLite's date() answers text, PostgreSQL's a date.
    return value if isinstance(value, date) else date.fromisoformat(str(value))
