"""Worker liveness: heartbeat rows, orphan detection, and the guarded hand-back writes."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from storage.jobs import (
    cancel_job,
    complete_job,
    create_job,
    fail_orphaned_jobs,
    get_job,
    mark_running,
    release_jobs,
    requeue_orphaned_jobs,
)
from storage.models import Job, JobStatus, Tenant, WorkerHeartbeat, utcnow
from storage.workers import (
    live_worker_ids,
    orphaned_jobs,
    prune_dead_workers,
    record_heartbeat,
    remove_worker,
)

ERROR = {"message": "lost", "type": "server_error", "param": None, "code": "worker_lost"}


def new_job(session: Session, tenant: Tenant, *, prompt: str = "hi") -> str:
    """A committed queued job's id."""
    job = create_job(session, tenant_id=tenant.id, priority="normal", model="m",
                     kind="text_completion", request={"prompt": prompt})
    session.commit()
    return job.id


def running_job(session: Session, tenant: Tenant, *, worker_id: str, claims: int = 1) -> str:
    """A committed job claimed `claims` times, last by `worker_id`."""
    job_id = new_job(session, tenant)
    for _ in range(claims):
        assert mark_running(session, job_id=job_id, worker_id=worker_id)
    session.commit()
    return job_id


def beat(session: Session, worker_id: str, *, seconds_ago: float = 0.0) -> None:
    """Commit a heartbeat of `worker_id` stamped `seconds_ago`."""
    record_heartbeat(session, worker_id=worker_id, now=utcnow() - timedelta(seconds=seconds_ago))
    session.commit()


def status_of(sessions: sessionmaker[Session], job_id: str) -> Job:
    """The job as committed, read in a fresh session."""
    with sessions() as session:
        job = get_job(session, job_id=job_id)
        assert job is not None
        return job


def test_first_beat_inserts_later_beats_update_and_remove_deletes(session: Session) -> None:
    beat(session, "w1", seconds_ago=100)
    first = session.scalars(select(WorkerHeartbeat)).one()
    assert (first.id, first.started_at) == ("w1", first.heartbeat_at)
    beat(session, "w1")
    session.expire_all()
    row = session.scalars(select(WorkerHeartbeat)).one()
    assert row.heartbeat_at - row.started_at >= timedelta(seconds=99)
    assert remove_worker(session, worker_id="w1")
    assert not remove_worker(session, worker_id="w1")
    session.commit()
    assert session.scalars(select(WorkerHeartbeat)).all() == []


def test_empty_worker_id_is_refused(session: Session) -> None:
    with pytest.raises(ValueError, match="worker_id"):
        record_heartbeat(session, worker_id="")


def test_prune_deletes_only_silent_workers(session: Session) -> None:
    beat(session, "alive", seconds_ago=1)
    beat(session, "dead", seconds_ago=120)
    dead_before = utcnow() - timedelta(seconds=30)
    assert live_worker_ids(session, dead_before=dead_before) == ["alive"]
    assert prune_dead_workers(session, dead_before=dead_before) == 1
    session.commit()
    assert [w.id for w in session.scalars(select(WorkerHeartbeat))] == ["alive"]


def test_orphans_are_running_jobs_of_silent_missing_or_no_workers(
    session: Session, tenant: Tenant
) -> None:
    beat(session, "alive", seconds_ago=1)
    beat(session, "silent", seconds_ago=120)
    kept = running_job(session, tenant, worker_id="alive")
    of_silent = running_job(session, tenant, worker_id="silent")
    of_missing = running_job(session, tenant, worker_id="never-beat")
    queued = new_job(session, tenant)
    finished = running_job(session, tenant, worker_id="silent")
    complete_job(session, job_id=finished, result={}, prompt_tokens=1, completion_tokens=1,
                 cached_tokens=0, first_token_at=None)
    # A row written before worker ids existed, or by hand: no owner at all.
    ownerless = running_job(session, tenant, worker_id="x")
    session.get(Job, ownerless).worker_id = None  # type: ignore[union-attr]
    session.commit()

    dead_before = utcnow() - timedelta(seconds=30)
    found = {job.id for job in orphaned_jobs(session, dead_before=dead_before, limit=10)}
    assert found == {of_silent, of_missing, ownerless}
    assert kept not in found and queued not in found
    assert len(orphaned_jobs(session, dead_before=dead_before, limit=2)) == 2
    with pytest.raises(ValueError, match="limit"):
        orphaned_jobs(session, dead_before=dead_before, limit=0)


def test_requeue_moves_orphans_with_attempts_left_and_fail_takes_the_spent(
    session: Session, sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    beat(session, "dead", seconds_ago=120)
    fresh = running_job(session, tenant, worker_id="dead", claims=1)
    spent = running_job(session, tenant, worker_id="dead", claims=3)
    dead_before = utcnow() - timedelta(seconds=30)
    ids = [fresh, spent]
    failed = fail_orphaned_jobs(session, job_ids=ids, worker_id="dead", dead_before=dead_before,
                                max_attempts=3, error=ERROR)
    requeued = requeue_orphaned_jobs(session, job_ids=ids, worker_id="dead",
                                     dead_before=dead_before, max_attempts=3)
    session.commit()
    assert (failed, requeued) == ([spent], [fresh])

    back = status_of(sessions, fresh)
    assert back.status is JobStatus.QUEUED and back.worker_id is None
    assert back.attempts == 1, "attempts count claims; the next claim makes it 2"
    gone = status_of(sessions, spent)
    assert gone.status is JobStatus.FAILED and gone.error == ERROR and gone.finished_at
    # Idempotent: a second reconciler (or pass) changes nothing.
    assert requeue_orphaned_jobs(session, job_ids=ids, worker_id="dead",
                                 dead_before=dead_before, max_attempts=3) == []
    assert fail_orphaned_jobs(session, job_ids=ids, worker_id="dead", dead_before=dead_before,
                              max_attempts=3, error=ERROR) == []


def test_a_beat_after_the_read_keeps_the_jobs(session: Session, tenant: Tenant) -> None:
    """The heartbeat is re-checked in the UPDATE: a worker that was only slow keeps its job."""
    beat(session, "slow", seconds_ago=120)
    job_id = running_job(session, tenant, worker_id="slow")
    dead_before = utcnow() - timedelta(seconds=30)
    assert [j.id for j in orphaned_jobs(session, dead_before=dead_before, limit=5)] == [job_id]
    beat(session, "slow")
    assert requeue_orphaned_jobs(session, job_ids=[job_id], worker_id="slow",
                                 dead_before=dead_before, max_attempts=3) == []
    assert fail_orphaned_jobs(session, job_ids=[job_id], worker_id="slow",
                              dead_before=dead_before, max_attempts=1, error=ERROR) == []
    assert get_job(session, job_id=job_id).status is JobStatus.RUNNING  # type: ignore[union-attr]


def test_a_job_claimed_by_another_worker_meanwhile_is_left_alone(
    session: Session, tenant: Tenant
) -> None:
    job_id = running_job(session, tenant, worker_id="dead")
    dead_before = utcnow() - timedelta(seconds=30)
    # Kafka redelivered it to another worker, which claimed it after the reconciler read.
    assert mark_running(session, job_id=job_id, worker_id="successor")
    assert requeue_orphaned_jobs(session, job_ids=[job_id], worker_id="dead",
                                 dead_before=dead_before, max_attempts=3) == []
    job = get_job(session, job_id=job_id)
    assert job is not None and (job.status, job.worker_id) == (JobStatus.RUNNING, "successor")


def test_ownerless_running_rows_are_handed_back_too(session: Session, tenant: Tenant) -> None:
    job_id = running_job(session, tenant, worker_id="x")
    session.get(Job, job_id).worker_id = None  # type: ignore[union-attr]
    session.commit()
    assert requeue_orphaned_jobs(session, job_ids=[job_id], worker_id=None,
                                 dead_before=utcnow(), max_attempts=3) == [job_id]


def test_release_hands_back_only_this_workers_running_jobs(
    session: Session, sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    mine = running_job(session, tenant, worker_id="me")
    theirs = running_job(session, tenant, worker_id="other")
    cancelled = running_job(session, tenant, worker_id="me")
    cancel_job(session, job_id=cancelled, tenant_id=tenant.id)
    queued = new_job(session, tenant)
    session.commit()

    released = release_jobs(session, job_ids=[mine, theirs, cancelled, queued, "job_missing"],
                            worker_id="me")
    session.commit()
    assert released == [mine]
    back = status_of(sessions, mine)
    assert (back.status, back.worker_id, back.attempts) == (JobStatus.QUEUED, None, 1)
    assert status_of(sessions, theirs).status is JobStatus.RUNNING
    assert status_of(sessions, cancelled).status is JobStatus.CANCELLED
    assert release_jobs(session, job_ids=[], worker_id="me") == []
    # The next claim counts the second attempt.
    assert mark_running(session, job_id=mine, worker_id="successor")
    session.commit()
    assert status_of(sessions, mine).attempts == 2
