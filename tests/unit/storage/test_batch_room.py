"""What the fan-out's window is planned from, on SQLite: waiting batches in deadline
order, queued batch jobs per model, priority and tenant, and the lines ahead of a batch."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import insert
from sqlalchemy.orm import Session

from storage.batch_room import queued_batch_lines, unqueued_lines_ahead, waiting_batches
from storage.batches import Batch, BatchStatus, create_batch
from storage.jobs import new_job_values
from storage.models import Job, JobStatus, Tenant, utcnow


def _batch(session: Session, tenant: Tenant, *, window_h: float, num_requests: int,
           num_enqueued: int = 0, priority: str = "low", model: str = "m",
           status: BatchStatus = BatchStatus.IN_PROGRESS) -> Batch:
    batch = create_batch(session, tenant_id=tenant.id, input_file_id="file-in",
                         endpoint="/v1/chat/completions", completion_window=f"{window_h}h",
                         expires_at=utcnow() + timedelta(hours=window_h), priority=priority)
    batch.status, batch.model = status, model
    batch.num_requests, batch.num_enqueued = num_requests, num_enqueued
    session.flush()
    return batch


def _jobs(session: Session, tenant: Tenant, *, n: int, status: JobStatus = JobStatus.QUEUED,
          batch_id: str | None = "b", model: str = "m", priority: str = "low") -> None:
    rows = [new_job_values(tenant_id=tenant.id, priority=priority, model=model,
                           kind="chat.completion", request={}, callback_url=None,
                           batch_id=batch_id, custom_id=None, deadline=None)
            for _ in range(n)]
    for row in rows:
        row["status"] = status
    session.execute(insert(Job), rows)


def test_waiting_batches_come_earliest_deadline_first(session: Session,
                                                      tenant: Tenant) -> None:
    lax = _batch(session, tenant, window_h=24, num_requests=10)
    soon = _batch(session, tenant, window_h=0.5, num_requests=10, num_enqueued=4)
    mid = _batch(session, tenant, window_h=2, num_requests=10)
    _batch(session, tenant, window_h=1, num_requests=10, num_enqueued=10)  # all enqueued
    _batch(session, tenant, window_h=1, num_requests=10, status=BatchStatus.CANCELLING)
    _batch(session, tenant, window_h=-1, num_requests=10)  # past its window
    session.commit()
    waiting = waiting_batches(session, now=utcnow())
    assert [(b.batch_id, b.num_left) for b in waiting] == [(soon.id, 6), (mid.id, 10),
                                                           (lax.id, 10)]
    assert unqueued_lines_ahead(session, lax, now=utcnow()) == 16
    assert unqueued_lines_ahead(session, soon, now=utcnow()) == 0


def test_queued_batch_lines_count_per_pair_and_tenant(session: Session, tenant: Tenant,
                                                      other_tenant: Tenant) -> None:
    _jobs(session, tenant, n=3)
    _jobs(session, tenant, n=2, priority="high")
    _jobs(session, other_tenant, n=4)
    _jobs(session, tenant, n=5, status=JobStatus.RUNNING)  # claimed: out of the window
    _jobs(session, tenant, n=6, batch_id=None)  # single jobs: no batch's window
    session.commit()
    assert queued_batch_lines(session) == {
        ("m", "low"): {tenant.id: 3, other_tenant.id: 4},
        ("m", "high"): {tenant.id: 2},
    }
