"""A job event's `data` is exactly what `GET /v1/jobs/{id}` returns for the job."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from api.schemas import JobPublic
from storage.jobs import cancel_job, complete_job, create_job, fail_job, get_job
from storage.models import Job, Tenant
from storage.webhook_events import enqueue_job_event, job_event_data

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def new_job(session: Session, tenant: Tenant, **fields: Any) -> Job:
    return create_job(session, tenant_id=tenant.id, priority="high", model="m",
                      kind="chat.completion", request=BODY, **fields)


def public(job: Job) -> dict[str, object]:
    return JobPublic.from_job(job).model_dump(mode="json")


def test_data_matches_the_api_view_for_every_terminal_status(
    session: Session, tenant: Tenant
) -> None:
    done = new_job(session, tenant, metadata={"k": "v"}, callback_url="https://x.example/h")
    complete_job(session, job_id=done.id, result={"object": "chat.completion"},
                 prompt_tokens=3, completion_tokens=2, cached_tokens=1, first_token_at=None)
    failed = new_job(session, tenant)
    fail_job(session, job_id=failed.id, error={"message": "boom"})
    cancelled = new_job(session, tenant)
    cancel_job(session, job_id=cancelled.id, tenant_id=tenant.id)
    session.commit()
    for job_id in (done.id, failed.id, cancelled.id):
        job = get_job(session, job_id=job_id)
        assert job is not None
        assert job_event_data(job) == public(job)


def test_job_events_are_enqueued_once_and_only_with_a_callback(
    session: Session, tenant: Tenant
) -> None:
    with_callback = new_job(session, tenant, callback_url="https://x.example/h")
    without = new_job(session, tenant)
    assert enqueue_job_event(session, job=with_callback) is None  # still queued
    for job in (with_callback, without):
        cancel_job(session, job_id=job.id, tenant_id=tenant.id)
    session.commit()
    cancelled = get_job(session, job_id=with_callback.id)
    assert cancelled is not None
    delivery = enqueue_job_event(session, job=cancelled)
    assert delivery is not None and delivery.event_type == "job.cancelled"
    assert delivery.payload["data"] == public(cancelled)
    assert enqueue_job_event(session, job=cancelled) is None  # a second cancel adds nothing
    other = get_job(session, job_id=without.id)
    assert other is not None and enqueue_job_event(session, job=other) is None
