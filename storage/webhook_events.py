"""Webhook events: their types, the payload envelope, and enqueueing one for delivery.

Whoever moves a job or batch to a terminal state calls `enqueue_job_event` (or
`enqueue_event`) in the same transaction as the status write, so the event is stored
exactly when the state change is: a crash either loses both or keeps both. The callback
worker does the rest.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.deliveries import create_delivery
from storage.models import Job, JobStatus, unix_seconds, utcnow
from storage.webhooks import Delivery


class EventType(enum.StrEnum):
    """The events a callback URL receives."""

    JOB_SUCCEEDED = "job.succeeded"
    JOB_FAILED = "job.failed"
    JOB_CANCELLED = "job.cancelled"
    JOB_EXPIRED = "job.expired"
    BATCH_COMPLETED = "batch.completed"
    BATCH_FAILED = "batch.failed"
    BATCH_EXPIRED = "batch.expired"
    BATCH_CANCELLED = "batch.cancelled"

    @property
    def is_job_event(self) -> bool:
        """True for `job.*` events (their object is a job), False for `batch.*`."""
        return self.value.startswith("job.")


JOB_STATUS_TO_EVENT: dict[JobStatus, EventType] = {
    JobStatus.SUCCEEDED: EventType.JOB_SUCCEEDED,
    JobStatus.FAILED: EventType.JOB_FAILED,
    JobStatus.CANCELLED: EventType.JOB_CANCELLED,
    JobStatus.EXPIRED: EventType.JOB_EXPIRED,
}

BATCH_STATUS_TO_EVENT: dict[str, EventType] = {
    "completed": EventType.BATCH_COMPLETED,
    "failed": EventType.BATCH_FAILED,
    "expired": EventType.BATCH_EXPIRED,
    "cancelled": EventType.BATCH_CANCELLED,
}


def event_envelope(
    event_type: EventType, data: dict[str, Any], *, at: datetime | None = None
) -> dict[str, Any]:
    """The body receivers get: `{"type", "timestamp", "data"}` (Standard Webhooks' shape)."""
    when = at or utcnow()
    return {
        "type": event_type.value,
        "timestamp": when.isoformat(timespec="microseconds").replace("+00:00", "Z"),
        "data": data,
    }


def enqueue_event(
    session: Session,
    *,
    tenant_id: str,
    event_type: EventType | str,
    url: str,
    payload: dict[str, Any],
) -> Delivery:
    """Store an event for delivery to `url`; the caller commits with its status change.

    `payload` is the object the event is about, as the API shows it (`GET /v1/jobs/{id}`
    or the batch object), with its `id`; it becomes the envelope's `data`.
    """
    kind = EventType(event_type)
    object_id = payload.get("id")
    if not isinstance(object_id, str) or not object_id:
        raise ValueError("an event's payload is the job or batch object, with its id")
    return create_delivery(
        session,
        tenant_id=tenant_id,
        event_type=kind.value,
        url=url,
        payload=event_envelope(kind, payload),
        job_id=object_id if kind.is_job_event else None,
        batch_id=None if kind.is_job_event else object_id,
    )


def job_event_data(job: Job) -> dict[str, Any]:
    """The job as `GET /v1/jobs/{id}` shows it (the API's `JobPublic`), as JSON values."""
    usage: dict[str, Any] | None = None
    if job.prompt_tokens is not None and job.completion_tokens is not None:
        usage = {
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.completion_tokens,
            "total_tokens": job.prompt_tokens + job.completion_tokens,
            "prompt_tokens_details": (
                {"cached_tokens": job.cached_tokens} if job.cached_tokens is not None else None
            ),
        }
    path = f"/v1/jobs/{job.id}"
    return {
        "id": job.id,
        "object": "job",
        "status": job.status.value,
        "priority": job.priority,
        "model": job.model,
        "created_at": unix_seconds(job.created_at),
        "started_at": unix_seconds(job.started_at),
        "finished_at": unix_seconds(job.finished_at),
        "result": job.result,
        "error": job.error,
        "usage": usage,
        "metadata": job.metadata_,
        "cached": (job.result or {}).get("cached"),
        "deadline": unix_seconds(job.deadline),
        # A finished job has no place in a queue and nothing left to estimate.
        "queue_position": None,
        "estimated_start_at": None,
        "estimated_completion_at": None,
        "links": {"self": path, "cancel": f"{path}/cancel"},
    }


def enqueue_job_event(session: Session, *, job: Job) -> Delivery | None:
    """Enqueue a finished job's event for its callback_url; None if none is due or it exists."""
    event_type = JOB_STATUS_TO_EVENT.get(job.status)
    if not job.callback_url or event_type is None:
        return None
    already = session.scalar(
        select(Delivery.id).where(Delivery.job_id == job.id,
                                  Delivery.event_type == event_type.value).limit(1)
    )
    if already is not None:
        return None
    return enqueue_event(session, tenant_id=job.tenant_id, event_type=event_type,
                         url=job.callback_url, payload=job_event_data(job))
