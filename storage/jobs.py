"""Job queries: create, read, list, and the status writes the worker and API make.

Every status write is one `UPDATE ... WHERE status IN (...)`, so two writers racing on a
job (a worker finishing it, a user cancelling it, a redelivered copy finishing it again)
cannot both win: the loser's call changes nothing and returns False. The statuses in each
WHERE come from `storage.states`. Functions flush but never commit: the caller owns the
transaction.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    CursorResult,
    Row,
    and_,
    bindparam,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.random_hex import random_hex
from core.topics import PRIORITIES, Priority
from storage.job_batches import Completion, complete_jobs
from storage.models import Job, JobStatus, utcnow
from storage.pages import keyset_page
from storage.states import UNFINISHED, sources_of, status_among_listed
from storage.workers import has_live_owner

logger = logging.getLogger(__name__)

JOB_KINDS = ("chat.completion", "text_completion", "embedding", "response")
MAX_LIST_LIMIT = 100


class IdempotencyKeyTaken(ValueError):
    """Another job of this tenant already holds the idempotency key (a lost race)."""


def new_job_id() -> str:
    """`job_` + 24 random hex characters."""
    return f"job_{random_hex(24)}"


def create_job(session: Session, **fields: Any) -> Job:
    """Add a queued job (`new_job(**fields)`) and flush it.

    Raises IdempotencyKeyTaken when a concurrent request inserted the same key first; the
    session must then be rolled back, after which `find_by_idempotency_key` finds the winner.
    """
    job = new_job(**fields)
    session.add(job)
    try:
        session.flush()
    except IntegrityError as e:
        key = job.idempotency_key
        if key is not None and "idempotency" in str(e.orig).lower():
            raise IdempotencyKeyTaken(
                f"idempotency key {key!r} is already used by another job; "
                "roll back and look it up with find_by_idempotency_key"
            ) from e
        raise
    return job


def new_job(**fields: Any) -> Job:
    """A new queued job row, not yet added to a session (see `new_job_values`)."""
    return Job(**new_job_values(**fields))


def new_job_values(
    *,
    tenant_id: str,
    priority: str | Priority,
    model: str,
    kind: str,
    request: dict[str, Any],
    callback_url: str | None = None,
    metadata: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    request_hash: str | None = None,
    batch_id: str | None = None,
    custom_id: str | None = None,
    cache_key: str | None = None,
    published: bool = False,
    deadline: datetime | None = None,
) -> dict[str, Any]:
    """A new queued job's values by `Job` attribute; ValueError for a bad priority or kind.

    As a dict, many rows go into one ORM bulk INSERT (`insert(Job)`) without an object
    each: what a batch's fan-out does, where building and flushing the objects cost more
    than the INSERT itself. `published`: stamped as produced now (`queued_at`), for a row
    whose record goes out right after it is stored; the reconciler's staleness clock reads
    the same either way.
    """
    priority_name = priority.value if isinstance(priority, Priority) else priority
    if priority_name not in PRIORITIES:
        raise ValueError(f"priority {priority_name!r} is not one of {', '.join(PRIORITIES)}")
    if kind not in JOB_KINDS:
        raise ValueError(f"job kind {kind!r} is not one of {', '.join(JOB_KINDS)}")
    now = utcnow()
    return {
        "id": new_job_id(),
        "tenant_id": tenant_id,
        "status": JobStatus.QUEUED,
        "priority": priority_name,
        "model": model,
        "kind": kind,
        "request": request,
        "callback_url": callback_url,
        "metadata_": metadata,
        "deadline": deadline,
        "idempotency_key": idempotency_key,
        "request_hash": request_hash,
        "batch_id": batch_id,
        "custom_id": custom_id,
        "cache_key": cache_key,
        "attempts": 0,
        "created_at": now,
        "queued_at": now if published else None,
    }


# The attributes `new_job_values` sets: what storing a new job writes.
NEW_JOB_FIELDS = (
    "id", "tenant_id", "status", "priority", "model", "kind", "request", "callback_url",
    "metadata_", "idempotency_key", "request_hash", "batch_id", "custom_id", "cache_key",
    "attempts", "created_at", "queued_at", "deadline",
)


def insert_new_jobs(session: Session, jobs: list[Job]) -> None:
    """INSERT new jobs (from `new_job`) in one statement; they stay out of the session.

    The unit of work's flush costs ~35 us a row more than one bulk INSERT of their values
    (bookkeeping each object's state, which a row written once and answered at once never
    needs). Raises IntegrityError as a flush would.
    """
    session.execute(insert(Job), [{key: getattr(job, key) for key in NEW_JOB_FIELDS}
                                  for job in jobs])


def find_by_idempotency_key(session: Session, *, tenant_id: str, key: str) -> Job | None:
    """The tenant's job created with this Idempotency-Key, or None."""
    query = select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == key)
    return session.scalars(query).one_or_none()


def get_job(session: Session, *, job_id: str, tenant_id: str | None = None) -> Job | None:
    """A job by id; with `tenant_id`, None unless that tenant owns it."""
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or (tenant_id is not None and job.tenant_id != tenant_id):
        return None
    return job


# What a reader of a job's state sees (`api.schemas.JobPublic`): every column but the
# request (bar its max_tokens), which can be the largest part of the row and which no
# such reader needs. Built once from the table's columns: a long-poll reads it at least
# once per job, and building the statement (or labelling an ORM attribute) costs more
# than running it.
_jobs = Job.__table__.c
_VIEW_COLUMNS = (
    _jobs.id, _jobs.status, _jobs.priority, _jobs.model, _jobs.created_at, _jobs.started_at,
    _jobs.finished_at, _jobs.result, _jobs.error, _jobs.prompt_tokens,
    _jobs.completion_tokens, _jobs.cached_tokens, _jobs.metadata.label("metadata_"),
    _jobs.deadline,
    # The one field of the request the estimates need (its expected output).
    _jobs.request["max_tokens"].as_integer().label("max_tokens"),
)
JOB_VIEW = select(*_VIEW_COLUMNS).where(
    _jobs.id == bindparam("job_id"), _jobs.tenant_id == bindparam("tenant_id"))
# Many jobs' views at once, each with its tenant for the reader to check.
JOB_VIEWS = select(*_VIEW_COLUMNS, _jobs.tenant_id).where(
    _jobs.id.in_(bindparam("job_ids", expanding=True)))
# Ids per statement: far below every database's limit on bound parameters.
MAX_VIEWS_PER_READ = 500


def job_view(
    connection: Connection, *, job_id: str, tenant_id: str
) -> Row[*tuple[Any, ...]] | None:
    """The tenant's job as `JOB_VIEW` reads it (attributes named as on `Job`), or None if
    missing or not theirs.

    On a plain connection rather than an ORM session, whose set-up and identity map cost
    three times the query itself.
    """
    return connection.execute(JOB_VIEW, {"job_id": job_id, "tenant_id": tenant_id}).first()


def job_views(connection: Connection, job_ids: list[str]) -> dict[str, Row[*tuple[Any, ...]]]:
    """`JOB_VIEW` of each existing job among `job_ids`, with its `tenant_id`, by id: one
    query per `MAX_VIEWS_PER_READ` ids, for a caller that answers many readers at once
    (and checks each reader's tenant itself)."""
    views: dict[str, Row[*tuple[Any, ...]]] = {}
    for start in range(0, len(job_ids), MAX_VIEWS_PER_READ):
        chunk = job_ids[start:start + MAX_VIEWS_PER_READ]
        for row in connection.execute(JOB_VIEWS, {"job_ids": chunk}):
            views[row.id] = row
    return views


def list_jobs(
    session: Session,
    *,
    tenant_id: str,
    status: JobStatus | None = None,
    limit: int = 20,
    after: str | None = None,
) -> tuple[list[Job], bool]:
    """A page of the tenant's jobs, newest first, and whether more follow.

    `after` is the id of the last job of the previous page. Order is (created_at, id)
    descending, so jobs created in the same instant still page without gaps or repeats.
    """
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}")
    query = select(Job).where(Job.tenant_id == tenant_id)
    if status is not None:
        query = query.where(Job.status == status)
    after_key = None
    if after is not None:
        cursor = get_job(session, job_id=after, tenant_id=tenant_id)
        if cursor is None:
            raise ValueError(f"unknown cursor {after!r}: pass the id of a job from the last page")
        after_key = (cursor.created_at, cursor.id)
    return keyset_page(session, query, created_at=Job.created_at, id=Job.id, after=after_key,
                       limit=limit)


def mark_published(session: Session, *, job_ids: list[str]) -> None:
    """Stamp queued jobs as produced to Kafka now (the reconciler's staleness clock)."""
    if not job_ids:
        return
    session.execute(
        update(Job)
        .where(Job.id.in_(job_ids), status_among_listed([JobStatus.QUEUED]))
        .values(queued_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    _expire(session, job_ids)


def mark_running(session: Session, *, job_id: str, worker_id: str) -> bool:
    """Claim a job for a worker (queued, or running after a redelivery); False if finished.

    Counts the attempt and restarts the clock: `started_at` is the latest claim's start.
    """
    return _update_status(
        session,
        job_id=job_id,
        new=JobStatus.RUNNING,
        values={"worker_id": worker_id, "attempts": Job.attempts + 1, "started_at": utcnow()},
    )


def complete_job(
    session: Session,
    *,
    job_id: str,
    result: dict[str, Any],
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    first_token_at: datetime | None,
) -> bool:
    """Store a result; True only if this call finished the job.

    Accepts queued jobs too (e.g. a result-cache hit never claimed): they pass through
    running in the same statement, and `started_at` is filled if it was never set.
    The statement is `job_batches.complete_jobs`' for one job.
    """
    completion = Completion(job_id, result, prompt_tokens, completion_tokens, cached_tokens,
                            first_token_at)
    changed = complete_jobs(session, [completion]) is not None
    if not changed:
        logger.debug("job %s not moved to succeeded: missing or already finished", job_id)
    return changed


def fail_job(session: Session, *, job_id: str, error: dict[str, Any]) -> bool:
    """Store an error; True only if this call finished the job."""
    return _update_status(
        session,
        job_id=job_id,
        new=JobStatus.FAILED,
        values={"error": error, "finished_at": utcnow()},
    )


def cancel_job(session: Session, *, job_id: str, tenant_id: str) -> Job | None:
    """Cancel the tenant's job if unfinished; returns it as it now is, None if not theirs.

    A finished job is returned unchanged, so the caller sees whether the cancel took
    (status `cancelled`) or came too late (status `succeeded` or `failed`).
    """
    job = get_job(session, job_id=job_id, tenant_id=tenant_id)
    if job is None:
        return None
    if _update_status(
        session, job_id=job_id, new=JobStatus.CANCELLED, values={"finished_at": utcnow()}
    ):
        logger.info("cancelled job %s", job_id)
    return get_job(session, job_id=job_id, tenant_id=tenant_id)


def stale_queued_jobs(session: Session, *, older_than: datetime, limit: int) -> list[Job]:
    """Queued jobs last published before `older_than` (or never, and created before it).

    Oldest first, at most `limit`: what the reconciler re-publishes.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    query = (
        select(Job)
        .where(
            Job.status == JobStatus.QUEUED,
            or_(
                Job.queued_at < older_than,
                and_(Job.queued_at.is_(None), Job.created_at < older_than),
            ),
        )
        .order_by(Job.created_at, Job.id)
        .limit(limit)
    )
    return list(session.scalars(query))


def release_jobs(session: Session, *, job_ids: list[str], worker_id: str) -> list[str]:
    """Hand this worker's running jobs back to the queue (it stops without them); ids moved.

    Guarded on status and worker_id: a job finished, cancelled or claimed by another
    worker meanwhile is left alone. `queued_at` keeps the last publish: Kafka redelivers
    the record whose offset the worker never committed, and should the broker have lost
    it, the reconciler re-publishes the job once it is stale.
    """
    return _hand_back(session, job_ids=job_ids, worker_id=worker_id, guards=[])


def requeue_orphaned_jobs(
    session: Session,
    *,
    job_ids: list[str],
    worker_id: str | None,
    dead_before: datetime,
    max_attempts: int,
) -> list[str]:
    """Hand back running jobs of a worker silent since `dead_before`, if attempts remain.

    The heartbeat is re-checked in the same statement, so a worker that beat after the
    caller's read keeps its jobs. Returns the ids moved to queued.
    """
    guards = [~has_live_owner(dead_before), Job.attempts < max_attempts]
    return _hand_back(session, job_ids=job_ids, worker_id=worker_id, guards=guards)


def fail_orphaned_jobs(
    session: Session,
    *,
    job_ids: list[str],
    worker_id: str | None,
    dead_before: datetime,
    max_attempts: int,
    error: dict[str, Any],
) -> list[str]:
    """Fail running jobs of a worker silent since `dead_before` that used their last attempt.

    Guarded like `requeue_orphaned_jobs`; returns the ids moved to failed.
    """
    guards = [~has_live_owner(dead_before), Job.attempts >= max_attempts]
    return _move_owned(session, job_ids=job_ids, worker_id=worker_id, guards=guards,
                       values={"status": JobStatus.FAILED, "error": error,
                               "finished_at": utcnow()})


def count_active_jobs(session: Session, *, tenant_id: str) -> int:
    """How many of the tenant's jobs are queued or running."""
    query = select(func.count(Job.id)).where(Job.tenant_id == tenant_id, Job.status.in_(UNFINISHED))
    return session.scalar(query) or 0


def _update_status(
    session: Session,
    *,
    job_id: str,
    new: JobStatus,
    values: dict[str, Any],
    sources: tuple[JobStatus, ...] | None = None,
) -> bool:
    """Move a job to `new` only from allowed statuses; True if this statement moved it."""
    allowed = sorted(sources_of(new) if sources is None else sources)
    statement = (
        update(Job)
        .where(Job.id == job_id, Job.status.in_(allowed))
        .values(status=new, **values)
        .execution_options(synchronize_session=False)
    )
    result = session.execute(statement)
    assert isinstance(result, CursorResult)
    _expire(session, [job_id])
    changed = result.rowcount == 1
    if not changed:
        logger.debug("job %s not moved to %s: missing or already finished", job_id, new.value)
    return changed


def _hand_back(
    session: Session,
    *,
    job_ids: list[str],
    worker_id: str | None,
    guards: list[ColumnElement[bool]],
) -> list[str]:
    """running → queued for these jobs of `worker_id` that pass `guards`; the ids moved."""
    # worker_id names the owner of a running job; a queued one has none.
    return _move_owned(session, job_ids=job_ids, worker_id=worker_id, guards=guards,
                       values={"status": JobStatus.QUEUED, "worker_id": None})


def _move_owned(
    session: Session,
    *,
    job_ids: list[str],
    worker_id: str | None,
    guards: list[ColumnElement[bool]],
    values: dict[str, Any],
) -> list[str]:
    """One guarded UPDATE of running jobs still claimed by `worker_id`; the ids it moved."""
    if not job_ids:
        return []
    owner = Job.worker_id.is_(None) if worker_id is None else Job.worker_id == worker_id
    statement = (
        update(Job)
        .where(Job.id.in_(job_ids), status_among_listed([JobStatus.RUNNING]), owner, *guards)
        .values(**values)
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    )
    moved = sorted(session.scalars(statement))
    _expire(session, job_ids)
    return moved


def _expire(session: Session, job_ids: list[str]) -> None:
    """Drop stale in-memory copies so later reads see what the UPDATE wrote."""
    for job_id in job_ids:
        job = session.identity_map.get(session.identity_key(Job, job_id))
        if job is not None:
            session.expire(job)


def expire_past_deadline(
    session: Session, *, now: datetime, limit: int
) -> list[tuple[Job, bool]]:
    """Move up to `limit` unfinished jobs whose deadline has passed to `expired`; each job
    moved with whether it was running (its engine must then abort it).

    A batch's jobs are left to their batch, whose window ends them with partial output
    kept (scheduler.batches). Guarded like every status write (`WHERE status IN`), so a
    result stored meanwhile wins and a later result write for an expired job is refused.
    """
    candidates = list(session.scalars(
        select(Job).where(Job.status.in_(UNFINISHED), Job.deadline < now,
                          Job.batch_id.is_(None))
        .order_by(Job.deadline, Job.id).limit(limit)
    ))  # fmt: skip
    if not candidates:
        return []
    before = {job.id: job.status for job in candidates}
    error = {"message": "the job did not finish before its deadline", "type": "expired",
             "param": "deadline", "code": "deadline_exceeded"}
    moved = session.execute(
        update(Job)
        .where(Job.id.in_(list(before)), Job.status.in_(UNFINISHED))
        .values(status=JobStatus.EXPIRED, finished_at=now, error=error)
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    )
    moved_ids = {job_id for (job_id,) in moved}
    _expire(session, list(moved_ids))
    return [(job, before[job.id] == JobStatus.RUNNING)
            for job in candidates if job.id in moved_ids]
