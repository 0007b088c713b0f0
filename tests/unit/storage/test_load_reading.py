"""What the estimates read: the work a finished job turned out to be (jobs table), and
what the live workers' engines have left (workers table)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy.orm import Session

from storage.estimates import read_loads
from storage.jobs import create_job
from storage.models import JobStatus, Tenant, utcnow
from storage.workers import record_heartbeat


def finished(session: Session, tenant: Tenant, *, max_tokens: int | None, completion: int,
             attempts: int = 1) -> None:
    job = create_job(session, tenant_id=tenant.id, priority="normal", model="m",
                     kind="chat.completion",
                     request={"model": "m", "messages": [], "max_tokens": max_tokens})
    job.status, job.finished_at, job.attempts = JobStatus.SUCCEEDED, utcnow(), attempts
    job.prompt_tokens, job.completion_tokens = 10, completion


def test_the_share_of_max_tokens_used_is_learned_from_jobs_that_ran(
        session: Session, tenant: Tenant) -> None:
    finished(session, tenant, max_tokens=100, completion=50)
    finished(session, tenant, max_tokens=40, completion=40)
    finished(session, tenant, max_tokens=None, completion=30)  # no limit: not in the share
    finished(session, tenant, max_tokens=1000, completion=1, attempts=0)  # a cache answer
    # A model is read while it has work (or live workers).
    create_job(session, tenant_id=tenant.id, priority="normal", model="m",
               kind="chat.completion", request={"model": "m", "messages": []})
    session.commit()
    reading = read_loads(session.connection(), dead_before=utcnow())["m"]
    assert reading.mean_output_fill == pytest.approx((0.5 + 1.0) / 2)
    assert reading.mean_completion_tokens == pytest.approx(40)
    assert reading.cache_hit_fraction == pytest.approx(0.25)


def test_the_work_live_workers_report_is_read_with_their_beat(session: Session) -> None:
    now = utcnow()
    record_heartbeat(session, worker_id="reports", now=now, model="m", tokens_per_s=500.0,
                     num_requests_left=3, num_tokens_to_compute=90, num_output_tokens_left=60,
                     solo_step_s=0.004)
    record_heartbeat(session, worker_id="silent", now=now, model="m", tokens_per_s=100.0)
    record_heartbeat(session, worker_id="dead", now=now - timedelta(minutes=5), model="m",
                     num_requests_left=1, num_tokens_to_compute=9, num_output_tokens_left=9)
    # A later beat without a report keeps the last one; a report of nothing is stored.
    record_heartbeat(session, worker_id="reports", now=now, model="m")
    session.commit()
    reading = read_loads(session.connection(), dead_before=now - timedelta(seconds=30))["m"]
    assert reading.num_workers == 2 and reading.tokens_per_s == pytest.approx(600.0)
    assert reading.solo_step_s == pytest.approx(0.004)  # of those that report one
    assert [(w.num_requests, w.num_tokens_to_compute, w.num_output_tokens, w.tokens_per_s)
            for w in reading.work_left] == [(3, 90, 60, 500.0)]
    assert reading.work_left[0].reported_at == now
    record_heartbeat(session, worker_id="reports", now=now, num_requests_left=0,
                     num_tokens_to_compute=0, num_output_tokens_left=0)
    session.commit()
    reading = read_loads(session.connection(), dead_before=now - timedelta(seconds=30))["m"]
    assert [w.num_tokens_to_compute for w in reading.work_left] == [0]


def test_running_jobs_are_told_apart_by_their_workers_report(
        session: Session, tenant: Tenant) -> None:
    """A job claimed after its worker's beat is in no report yet; a job of a worker that
    reports nothing counts apart."""
    beat = utcnow() - timedelta(seconds=2)
    record_heartbeat(session, worker_id="reports", now=beat, model="m",
                     num_requests_left=1, num_tokens_to_compute=10, num_output_tokens_left=5)
    record_heartbeat(session, worker_id="remote", now=beat, model="m")
    claims = [("reports", beat - timedelta(seconds=1)), ("reports", beat + timedelta(seconds=1)),
              ("remote", beat)]
    for worker_id, started_at in claims:
        job = create_job(session, tenant_id=tenant.id, priority="normal", model="m",
                         kind="chat.completion", request={"model": "m", "messages": []})
        job.status, job.worker_id, job.started_at = JobStatus.RUNNING, worker_id, started_at
    session.commit()
    reading = read_loads(session.connection(), dead_before=beat - timedelta(seconds=30))["m"]
    assert [(w.num_claimed_before, w.num_claimed_since) for w in reading.work_left] \
        == [(1, 1)]
    assert reading.num_running_unreported == 1


def test_each_batchs_jobs_are_read_with_the_queue(session: Session, tenant: Tenant) -> None:
    """Per batch: its queued jobs and the one workers take last (latest deadline, then
    latest created), its running ones and the last started; single jobs in no batch. The
    first claim since a worker's beat is kept (an idle worker's pace starts there)."""
    t0 = utcnow() - timedelta(minutes=1)
    record_heartbeat(session, worker_id="w", now=t0, model="m", num_requests_left=0,
                     num_tokens_to_compute=0, num_output_tokens_left=0)
    rows = [("a", JobStatus.QUEUED, t0 + timedelta(hours=2), 1, None),
            ("a", JobStatus.QUEUED, t0 + timedelta(hours=1), 9, None),
            ("a", JobStatus.RUNNING, t0 + timedelta(hours=2), 0, 5),
            ("a", JobStatus.RUNNING, t0 + timedelta(hours=2), 0, 3),
            ("b", JobStatus.QUEUED, None, 2, None),
            (None, JobStatus.QUEUED, None, 3, None)]
    for batch_id, status, deadline, created_s, started_s in rows:
        job = create_job(session, tenant_id=tenant.id, priority="normal", model="m",
                         kind="chat.completion", request={"model": "m", "messages": []},
                         batch_id=batch_id, deadline=deadline)
        job.status, job.created_at = status, t0 + timedelta(seconds=created_s)
        if started_s is not None:
            job.worker_id, job.started_at = "w", t0 + timedelta(seconds=started_s)
    session.commit()
    reading = read_loads(session.connection(), dead_before=t0 - timedelta(seconds=30))["m"]
    a, b = reading.batch_tails["a"], reading.batch_tails["b"]
    assert (a.num_queued, a.num_running, a.num_unfinished) == (2, 2, 4)
    assert a.last_deadline == t0 + timedelta(hours=2)  # not the later-created one
    assert a.last_created_at == t0 + timedelta(seconds=1)
    assert a.last_started_at == t0 + timedelta(seconds=5)
    assert (b.num_queued, b.num_running, b.last_deadline) == (1, 0, None)
    assert set(reading.batch_tails) == {"a", "b"}
    [worker] = reading.work_left
    assert worker.is_idle_at_beat and worker.num_claimed_since == 2
    assert worker.first_claimed_since == t0 + timedelta(seconds=3)
