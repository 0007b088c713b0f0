"""Webhook events: their types, the payload envelope, and enqueueing one for delivery.

Whoever moves a job or batch to a terminal state calls `enqueue_event` in the same
transaction as the status write, so the event is stored exactly when the state change
is: a crash either loses both or keeps both. The callback worker does the rest.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from storage.deliveries import create_delivery
from storage.models import JobStatus, utcnow
from storage.webhooks import Delivery


class EventType(enum.StrEnum):
    """The events a callback URL receives."""

    JOB_SUCCEEDED = "job.succeeded"
    JOB_FAILED = "job.failed"
    JOB_CANCELLED = "job.cancelled"
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
