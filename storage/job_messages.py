"""The Kafka message that carries a stored job, from its row or from the values a new
row is stored with (`storage.jobs.new_job_values`)."""

from __future__ import annotations

from typing import Any

from core.messages import JobMessage
from storage.models import Job


def job_message(job: Job) -> JobMessage:
    """The Kafka message that carries a stored job (its next claim is attempt + 1)."""
    return JobMessage(
        job_id=job.id,
        tenant_id=job.tenant_id,
        priority=job.priority,
        model=job.model,
        kind=job.kind,  # type: ignore[arg-type]
        body=job.request,
        batch_id=job.batch_id,
        custom_id=job.custom_id,
        cache_key=job.cache_key,
        attempt=job.attempts + 1,
        has_callback=job.callback_url is not None,
        deadline=job.deadline.timestamp() if job.deadline is not None else None,
        created_at=job.created_at.timestamp() if job.created_at is not None else None,
    )


def new_job_message(values: dict[str, Any]) -> JobMessage:
    """`job_message` of a job stored from `new_job_values` (its first claim is attempt 1)."""
    return JobMessage(
        job_id=values["id"],
        tenant_id=values["tenant_id"],
        priority=values["priority"],
        model=values["model"],
        kind=values["kind"],
        body=values["request"],
        batch_id=values["batch_id"],
        custom_id=values["custom_id"],
        cache_key=values["cache_key"],
        attempt=values["attempts"] + 1,
        has_callback=values["callback_url"] is not None,
        deadline=values["deadline"].timestamp() if values.get("deadline") else None,
        created_at=values["created_at"].timestamp(),
    )
