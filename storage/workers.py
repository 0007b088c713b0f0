"""Worker liveness: heartbeat rows, and the running jobs no live worker owns.

A worker writes its row before it claims anything and beats it every few seconds; a
running job belongs to the worker named in `jobs.worker_id`. The job is orphaned when
that worker has no row (it stopped, or was never recorded) or a row whose last beat is
older than the heartbeat timeout (it crashed, or hangs). The reconciler hands orphans back
to the queue with the guarded writes in `storage.jobs`, which re-check the heartbeat in
the same statement, so a worker that beats between the read and the write keeps its job.

Times come from each process's own clock, like every timestamp in these tables, so the
hosts' clocks must agree to well within the heartbeat timeout (NTP does).

Functions flush but never commit: the caller owns the transaction.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import ColumnElement, CursorResult, delete, exists, insert, select, update
from sqlalchemy.orm import Session

from storage.models import Job, JobStatus, WorkerHeartbeat, utcnow

logger = logging.getLogger(__name__)


def record_heartbeat(
    session: Session,
    *,
    worker_id: str,
    now: datetime | None = None,
    model: str | None = None,
    tokens_per_s: float | None = None,
    step_s: float | None = None,
    num_requests_left: int | None = None,
    num_tokens_to_compute: int | None = None,
    num_output_tokens_left: int | None = None,
    solo_step_s: float | None = None,
) -> None:
    """Stamp the worker alive now; the first beat (or one after a prune) inserts its row.

    `model`, `tokens_per_s`, `step_s` and `solo_step_s` (its served model and measured
    pace) and the work its engine's live requests have left (`num_*_left`,
    `num_tokens_to_compute`: see storage.models.WorkerHeartbeat) are stored when given,
    for the estimates; a figure not given leaves the stored one.
    """
    if not worker_id:
        raise ValueError("worker_id must be a non-empty string, e.g. '<host>-<pid>'")
    now = now or utcnow()
    pace = {name: value for name, value in
            (("model", model), ("tokens_per_s", tokens_per_s), ("step_s", step_s),
             ("num_requests_left", num_requests_left),
             ("num_tokens_to_compute", num_tokens_to_compute),
             ("num_output_tokens_left", num_output_tokens_left),
             ("solo_step_s", solo_step_s))
            if value is not None}  # fmt: skip
    result = session.execute(
        update(WorkerHeartbeat)
        .where(WorkerHeartbeat.id == worker_id)
        .values(heartbeat_at=now, **pace)
        .execution_options(synchronize_session=False)
    )
    assert isinstance(result, CursorResult)
    if result.rowcount == 0:
        # One process per id, so no other writer inserts this row concurrently.
        session.execute(insert(WorkerHeartbeat).values(id=worker_id, started_at=now,
                                                       heartbeat_at=now, **pace))


def remove_worker(session: Session, *, worker_id: str) -> bool:
    """Delete the worker's row (it stops); True if there was one.

    Jobs it still holds `running` count as orphaned from then on.
    """
    result = session.execute(delete(WorkerHeartbeat).where(WorkerHeartbeat.id == worker_id))
    assert isinstance(result, CursorResult)
    return result.rowcount == 1


def prune_dead_workers(session: Session, *, dead_before: datetime) -> int:
    """Delete the rows of workers silent since before `dead_before`; how many.

    Safe at any time: a missing row and a stale one mean the same (no live owner), and a
    worker that was only slow re-inserts its row with its next beat.
    """
    result = session.execute(
        delete(WorkerHeartbeat).where(WorkerHeartbeat.heartbeat_at < dead_before)
    )
    assert isinstance(result, CursorResult)
    return result.rowcount


def remove_workers(session: Session, *, worker_ids: list[str]) -> int:
    """Delete these workers' rows (known dead); how many there were.

    Their running jobs count as orphaned at once, not after the heartbeat timeout.
    """
    if not worker_ids:
        return 0
    result = session.execute(delete(WorkerHeartbeat).where(WorkerHeartbeat.id.in_(worker_ids)))
    assert isinstance(result, CursorResult)
    return result.rowcount


def worker_ids(session: Session) -> list[str]:
    """Ids of every worker with a row (alive or not), sorted."""
    return list(session.scalars(select(WorkerHeartbeat.id).order_by(WorkerHeartbeat.id)))


def live_worker_ids(session: Session, *, dead_before: datetime) -> list[str]:
    """Ids of workers that beat at or after `dead_before`, sorted."""
    query = (
        select(WorkerHeartbeat.id)
        .where(WorkerHeartbeat.heartbeat_at >= dead_before)
        .order_by(WorkerHeartbeat.id)
    )
    return list(session.scalars(query))


def has_live_owner(dead_before: datetime) -> ColumnElement[bool]:
    """SQL condition on a jobs row: its worker beat at or after `dead_before`."""
    return exists().where(
        WorkerHeartbeat.id == Job.worker_id, WorkerHeartbeat.heartbeat_at >= dead_before
    )


def orphaned_jobs(session: Session, *, dead_before: datetime, limit: int) -> list[Job]:
    """Running jobs whose worker has not beaten since `dead_before` (or has no row).

    Longest-running claim first, at most `limit`.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    query = (
        select(Job)
        .where(
            Job.status == JobStatus.RUNNING,
            # A NULL worker_id matches no row, so it counts as orphaned too.
            ~has_live_owner(dead_before),
        )
        .order_by(Job.started_at, Job.id)
        .limit(limit)
    )
    return list(session.scalars(query))
