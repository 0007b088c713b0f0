"""Job reads, claims and results for many jobs in one statement: what a worker does per
poll and per engine step.

A worker that starts a hundred short jobs per poll cannot afford a transaction per job
(three round trips and a commit each, at a thousand jobs a second). These run one
statement for the whole set and keep the guarantees of the single-job calls in
`storage.jobs`: a claim only moves jobs whose status allows it, atomically in SQL, and
says which it moved. Functions flush but never commit: the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, bindparam, func, or_, select, update
from sqlalchemy.orm import Session

from storage.executemany import ManyStatement
from storage.models import Job, JobStatus, UTCDateTime, utcnow
from storage.states import UNFINISHED, sources_of, status_among_listed


def load_statuses(
    session: Session, *, job_ids: Collection[str]
) -> dict[str, tuple[JobStatus, datetime, int]]:
    """Job id → (status, created_at, attempts) for the ids that have a row."""
    if not job_ids:
        return {}
    rows = session.execute(
        select(Job.id, Job.status, Job.created_at, Job.attempts).where(Job.id.in_(list(job_ids)))
    )
    return {job_id: (status, created_at, attempts or 0)
            for job_id, status, created_at, attempts in rows}


def claim_jobs(session: Session, *, job_ids: Collection[str], worker_id: str) -> set[str]:
    """Mark these jobs running on `worker_id` where still unfinished; the ids claimed.

    Like `jobs.mark_running` for each: counts the attempt, restarts `started_at`.
    """
    if not job_ids:
        return set()
    statement = (
        update(Job)
        .where(Job.id.in_(list(job_ids)), status_among_listed(sources_of(JobStatus.RUNNING)))
        .values(status=JobStatus.RUNNING, worker_id=worker_id, attempts=Job.attempts + 1,
                started_at=utcnow())
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    )
    return set(session.scalars(statement))


@dataclass(frozen=True, slots=True)
class Completion:
    """A result for `complete_jobs`, with the token counts of its `usage`."""

    job_id: str
    result: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    first_token_at: datetime | None


def _complete_statement() -> ManyStatement:
    table: Table = Job.__table__  # type: ignore[assignment]  # a Table, typed as FromClause
    now = bindparam("b_now", type_=UTCDateTime())
    # Constants, not an IN list: expanding parameters cannot run as executemany.
    unfinished = or_(*(table.c.status == status for status in UNFINISHED))
    return ManyStatement(
        update(table)
        .where(table.c.id == bindparam("b_id"), unfinished)
        .values(status=JobStatus.SUCCEEDED, result=bindparam("b_result"), error=None,
                prompt_tokens=bindparam("b_prompt_tokens"),
                completion_tokens=bindparam("b_completion_tokens"),
                cached_tokens=bindparam("b_cached_tokens"),
                first_token_at=bindparam("b_first_token_at"),
                started_at=func.coalesce(table.c.started_at, now), finished_at=now)
    )


_COMPLETE = _complete_statement()


def complete_jobs(session: Session, completions: list[Completion]) -> set[str] | None:
    """Store every result with one statement run for each (executemany): the ids finished,
    or None when some job was no longer unfinished.

    A queued job passes through running in the same statement (a result-cache hit never
    claimed), `started_at` filled if it was never set; `jobs.complete_job` is this for one.
    One statement cannot say which rows it skipped, only how many it changed; on None the
    caller rolls the transaction back and stores the results one by one to learn which
    jobs were finished elsewhere (a rare race: a cancellation, or a redelivered copy that
    finished first).
    """
    if not completions:
        return set()
    changed = _COMPLETE.run(session, [
        {"b_id": c.job_id, "b_result": c.result, "b_prompt_tokens": c.prompt_tokens,
         "b_completion_tokens": c.completion_tokens, "b_cached_tokens": c.cached_tokens,
         "b_first_token_at": c.first_token_at} for c in completions],
        shared={"b_now": utcnow()})
    if changed != len(completions):
        return None
    if session.identity_map:  # objects loaded here earlier must not show the old row
        for c in completions:
            job = session.identity_map.get(session.identity_key(Job, c.job_id))
            if job is not None:
                session.expire(job)
    return {c.job_id for c in completions}
