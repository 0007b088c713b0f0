"""A job's state as routes need it: read it now, wait for it to finish, cancel it.

Each read uses a connection of its own that ends at once, so a long wait never holds a
database transaction (which on SQLite would also pin an old snapshot of the row). A wait
registers with the process's JobDoneHub (storage.job_done_hub) and costs no Redis round
trip; while the hub is not listening it subscribes on its own.

A wait woken by a worker's grouped announcement usually gets its job's view with the
wake-up: the hub reads every announced job's view in one query (`read_finished_views`).

A wait reads the job's view first, not its status: the view leaves the request out
(`storage.jobs.JOB_VIEW`), so it costs about what the status alone does, and a job
that finished before its long-poll arrived (the common case once the engine is fast) is
answered in one read instead of two. A wait for a job this process stored, of which the
hub has heard nothing since, skips that read: the job has not finished, and its
completion will wake the wait (see the hub's "Jobs expected"). Whatever it read first, a
wait that hears nothing reads its job again every RECHECK_S, so a lost announcement costs
seconds, not the rest of the wait.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.resources import Resources
from api.schemas import JobPublic
from storage.events import (
    poll_until_done,
    publish_cancel,
    publish_job_done,
    wait_job_done,
)
from storage.jobs import cancel_job, job_view, job_views
from storage.models import Job, JobStatus
from storage.webhook_events import enqueue_job_event

# How often a long-poll woken by nothing reads its job anyway (see `_heard_or_done`).
RECHECK_S = 5.0


def load_job(resources: Resources, *, job_id: str, tenant_id: str) -> JobPublic | None:
    """The tenant's job as the database has it now; None if missing or not theirs."""
    with resources.engine.connect() as connection:
        row = job_view(connection, job_id=job_id, tenant_id=tenant_id)
    if row is None:
        return None
    view = JobPublic.from_job(row)
    if not row.status.is_terminal:  # from the last reading of the load: no query here
        view.with_estimate(resources.estimates.estimate(
            model=row.model, priority=row.priority, status=row.status, created_at=row.created_at,
            deadline=row.deadline, started_at=row.started_at, max_tokens=row.max_tokens))
    return view


async def _read_view(resources: Resources, *, job_id: str, tenant_id: str) -> JobPublic | None:
    """`load_job` from the event loop: on the loop itself where the database is SQLite,
    on the thread pool where it is a server.

    A read of SQLite in WAL mode never waits for a lock (writers do not block readers) and
    takes ~40 us from the page cache, while the hop to a pool thread and back cost the API
    ~0.5 ms of CPU per long-polled job (1.75-1.96 -> 1.24-1.29 ms end to end). A server
    can be a network round trip away, or stall: that read stays off the loop.
    """
    if resources.engine.dialect.name == "sqlite":
        return load_job(resources, job_id=job_id, tenant_id=tenant_id)
    return await run_in_threadpool(load_job, resources, job_id=job_id, tenant_id=tenant_id)


async def read_finished_views(resources: Resources, job_ids: list[str]) -> dict[str, Any]:
    """The views of announced jobs for the hub to hand their waiters, in one query; like
    `_read_view`, on the event loop where the database is SQLite."""
    def read() -> dict[str, Any]:
        with resources.engine.connect() as connection:
            return job_views(connection, job_ids)

    if resources.engine.dialect.name == "sqlite":
        return read()
    return await run_in_threadpool(read)


async def wait_for_job(
    resources: Resources, *, job_id: str, tenant_id: str, timeout: float
) -> JobPublic | None:
    """The job once it finishes, or as it is when `timeout` seconds have passed."""
    hub = resources.done_hub
    if timeout <= 0 or not hub.is_listening:
        return await _wait_alone(resources, job_id=job_id, tenant_id=tenant_id,
                                 timeout=timeout)
    deadline = time.monotonic() + timeout
    # Registered before the read: a completion committed after it wakes this wait. A job
    # this process stored and has heard nothing of since is unfinished: nothing to read.
    woken = hub.register(job_id)
    try:
        if not hub.unheard(job_id, tenant_id):
            view = await _read_view(resources, job_id=job_id, tenant_id=tenant_id)
            if view is None or view.status.is_terminal:
                return view
        heard = await _heard_or_done(resources, woken, job_id=job_id, tenant_id=tenant_id,
                                     deadline=deadline)
        if heard is False:  # the hub lost Redis meanwhile: poll for what is left of the wait
            await poll_until_done(lambda: _is_done(resources, job_id, tenant_id),
                                  deadline - time.monotonic())
        elif heard is not True and heard.tenant_id == tenant_id and heard.status.is_terminal:
            return JobPublic.from_job(heard)  # the view read with the announcement
        return await _read_view(resources, job_id=job_id, tenant_id=tenant_id)
    finally:
        hub.unregister(job_id, woken)


async def _heard_or_done(resources: Resources, woken: asyncio.Future[Any], *, job_id: str,
                         tenant_id: str, deadline: float) -> Any:
    """What the hub woke the wait with; True once the database shows the job finished, or
    the deadline passed (read it as it is).

    Every RECHECK_S the database is asked: an announcement can be lost without the hub
    losing its subscription (a worker's publish failing alone), and the wait would then
    last until its deadline however long ago the job finished.
    """
    while True:
        remaining = deadline - time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(woken), min(remaining, RECHECK_S))
        except TimeoutError:
            if remaining <= RECHECK_S or await _is_done(resources, job_id, tenant_id):
                return True


async def _wait_alone(
    resources: Resources, *, job_id: str, tenant_id: str, timeout: float
) -> JobPublic | None:
    """`wait_for_job` with a subscription of its own (while the hub is not listening)."""
    view = await _read_view(resources, job_id=job_id, tenant_id=tenant_id)
    if view is None or view.status.is_terminal or timeout <= 0:
        return view
    await wait_job_done(resources.aredis, prefix=resources.settings.topic_prefix,
                        job_id=job_id, timeout=timeout,
                        is_done=lambda: _is_done(resources, job_id, tenant_id))
    return await _read_view(resources, job_id=job_id, tenant_id=tenant_id)


async def _is_done(resources: Resources, job_id: str, tenant_id: str) -> bool:
    """Whether the database shows the job finished (or gone)."""
    fresh = await _read_view(resources, job_id=job_id, tenant_id=tenant_id)
    return fresh is None or fresh.status.is_terminal


def cancel_and_announce(
    session: Session, redis_client: redis.Redis, *, prefix: str, job_id: str, tenant_id: str
) -> Job | None:
    """Cancel the tenant's job if unfinished and commit; None if missing or not theirs.

    The job comes back as it now is: `cancelled`, or the status it had already finished
    with. Only after the commit are the events published: workers running it abort it,
    long-polls waiting on it return.
    """
    job = cancel_job(session, job_id=job_id, tenant_id=tenant_id)
    if job is not None and job.status is JobStatus.CANCELLED:
        enqueue_job_event(session, job=job)  # with the status change; idempotent
    session.commit()
    if job is not None and job.status is JobStatus.CANCELLED:
        publish_cancel(redis_client, prefix=prefix, job_id=job_id)
        publish_job_done(redis_client, prefix=prefix, job_id=job_id, status=JobStatus.CANCELLED)
    return job
