"""Queries over the jobs of one batch: counts, usage, streaming reads and stopping them.

Counts and status updates ride `ix_jobs_batch (batch_id, status)`; streaming a batch's
jobs in creation order rides `ix_jobs_batch_created (batch_id, created_at, id)`, declared
here and created by this module's migration (0002), so each page is an index range scan
rather than a sort of the whole batch. Reads that can return a whole batch (50,000 jobs)
page and return plain rows, not ORM objects, so the session's identity map never holds
the batch. The caller commits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Index, Text, cast, func, literal, select, tuple_, update
from sqlalchemy.orm import Session

from storage.models import Job, JobStatus, UTCDateTime, utcnow

# Jobs fetched per round trip when streaming a batch's results.
PAGE_SIZE = 500

# Keyset pages over one batch in creation order (iter_batch_jobs).
BATCH_CREATED_INDEX = Index("ix_jobs_batch_created", Job.batch_id, Job.created_at, Job.id)


@dataclass(frozen=True, slots=True)
class BatchJobCounts:
    """How many of a batch's jobs are in each status."""

    num_queued: int = 0
    num_running: int = 0
    num_succeeded: int = 0
    num_failed: int = 0
    num_cancelled: int = 0

    @property
    def num_unfinished(self) -> int:
        """Jobs that may still change (queued or running)."""
        return self.num_queued + self.num_running


@dataclass(frozen=True, slots=True)
class BatchJobUsage:
    """Tokens summed over a batch's succeeded jobs."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class BatchJobRow:
    """What the output and error files need of one job. `result_json` is the stored result
    as the database holds it (JSON text), for writers that copy it into a line as is."""

    job_id: str
    custom_id: str
    status: JobStatus
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    result_json: str | None = None


def count_batch_jobs(session: Session, *, batch_id: str) -> BatchJobCounts:
    """Counts of the batch's jobs by status."""
    query = select(Job.status, func.count()).where(Job.batch_id == batch_id).group_by(Job.status)
    status_to_count = {JobStatus(status): count for status, count in session.execute(query)}
    return BatchJobCounts(
        num_queued=status_to_count.get(JobStatus.QUEUED, 0),
        num_running=status_to_count.get(JobStatus.RUNNING, 0),
        num_succeeded=status_to_count.get(JobStatus.SUCCEEDED, 0),
        num_failed=status_to_count.get(JobStatus.FAILED, 0),
        num_cancelled=status_to_count.get(JobStatus.CANCELLED, 0),
    )


def sum_batch_usage(session: Session, *, batch_id: str) -> BatchJobUsage:
    """Input, cached input and output tokens over the batch's succeeded jobs."""
    query = select(
        func.coalesce(func.sum(Job.prompt_tokens), 0),
        func.coalesce(func.sum(Job.cached_tokens), 0),
        func.coalesce(func.sum(Job.completion_tokens), 0),
    ).where(Job.batch_id == batch_id, Job.status == JobStatus.SUCCEEDED)
    input_tokens, cached_tokens, output_tokens = session.execute(query).one()
    return BatchJobUsage(
        input_tokens=int(input_tokens or 0), cached_tokens=int(cached_tokens or 0),
        output_tokens=int(output_tokens or 0),
    )


def iter_batch_jobs(
    session: Session, *, batch_id: str, page_size: int = PAGE_SIZE
) -> Iterator[BatchJobRow]:
    """Every job of the batch in creation order (the input file's), a page per query.

    The result comes as its JSON text (`result_json`; `result` is None): decoding and
    re-encoding it cost the output file most of its time (an embedding is hundreds of
    floats), and the file only copies it.
    """
    columns = (Job.id, Job.custom_id, Job.status, cast(Job.result, Text), Job.error,
               Job.created_at)
    query = select(*columns).where(Job.batch_id == batch_id)
    after: tuple[datetime, str] | None = None
    while True:
        page = query
        if after is not None:
            at = tuple_(literal(after[0], UTCDateTime), literal(after[1]))
            page = page.where(tuple_(Job.created_at, Job.id) > at)
        rows = session.execute(page.order_by(Job.created_at, Job.id).limit(page_size)).all()
        for job_id, custom_id, status, result_json, error, _ in rows:
            yield BatchJobRow(job_id=job_id, custom_id=custom_id or "",
                              status=JobStatus(status), result=None, error=error,
                              result_json=result_json)
        if len(rows) < page_size:
            return
        after = (rows[-1][5], rows[-1][0])


def has_jobs_stopped_since(session: Session, *, batch_id: str, since: datetime) -> bool:
    """Whether a job of the batch was cancelled at or after `since`.

    Past the batch's `expires_at`, such a job was stopped by its expiry (stop_batch_jobs),
    not by the user while the window was open.
    """
    query = select(Job.id).where(
        Job.batch_id == batch_id, Job.status == JobStatus.CANCELLED, Job.finished_at >= since
    ).limit(1)
    return session.scalar(query) is not None


def stop_batch_jobs(session: Session, *, batch_id: str) -> list[str]:
    """Cancel every unfinished job of the batch; returns the ids of those that were running.

    Queued jobs go first, so none can start between the two statements; a worker's later
    claim or result write for any of them is refused, since both need queued or running.
    The running ones are returned so the caller can abort them in the engine.
    """
    now = utcnow()
    session.execute(
        update(Job)
        .where(Job.batch_id == batch_id, Job.status == JobStatus.QUEUED)
        .values(status=JobStatus.CANCELLED, finished_at=now)
        .execution_options(synchronize_session=False)
    )
    running = session.execute(
        update(Job)
        .where(Job.batch_id == batch_id, Job.status == JobStatus.RUNNING)
        .values(status=JobStatus.CANCELLED, finished_at=now)
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    )
    return [job_id for (job_id,) in running]
