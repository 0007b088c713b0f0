"""Job reads and claims for many jobs in one statement: what a worker does per poll.

A worker that starts a hundred short jobs per poll cannot afford a transaction per job
(three round trips and a commit each, at a thousand jobs a second). These run one
statement for the whole set and keep the guarantees of the single-job calls in
`storage.jobs`: a claim only moves jobs whose status allows it, atomically in SQL, and
says which it moved. Functions flush but never commit: the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from storage.models import Job, JobStatus, utcnow
from storage.states import sources_of


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
        .where(Job.id.in_(list(job_ids)), Job.status.in_(sorted(sources_of(JobStatus.RUNNING))))
        .values(status=JobStatus.RUNNING, worker_id=worker_id, attempts=Job.attempts + 1,
                started_at=utcnow())
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    )
    return set(session.scalars(statement))
