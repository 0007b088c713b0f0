"""Produce stored jobs to Kafka a page at a time, telling a bad row from a bad broker.

Responsible for: building each job's message, sending the page, waiting for the broker's
acknowledgements, sorting every job of the page into one of three outcomes, and storing
what they mean (`record_output`):
- published: the broker has it;
- unpublishable: no message can ever carry this row (its text cannot be encoded, it is
  larger than a record may be, a field fails the message schema, its model is no longer
  served, so no topic of it is consumed or even exists). Retrying cannot help,
  so the caller fails the job with the reason and moves on: one bad row never holds
  back the rows behind it;
- unsent: the broker did not answer (down, slow, no leader). Nothing is wrong with the
  job; it stays stale and a later pass sends it again (`raise_for_broker` after the rest
  is stored).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaProducer
from kafka.errors import (
    InvalidRecordError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
)
from kafka.producer.future import FutureRecordMetadata
from sqlalchemy.orm import Session

from core import metrics
from core.kafka import publish_job
from core.messages import JobMessage
from core.settings import Settings
from storage.job_messages import job_message
from storage.jobs import fail_job, get_job, mark_published
from storage.models import Job
from storage.webhook_events import enqueue_job_event

logger = logging.getLogger(__name__)

# Broker and client errors about one record itself, not about the broker: sending the
# same record again fails the same way.
RECORD_ERRORS: tuple[type[KafkaError], ...] = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    InvalidRecordError,
)


@dataclass(slots=True)
class PublishOutput:
    """What became of one page of jobs (see the module docstring)."""

    published_ids: list[str] = field(default_factory=list)
    # job id → why no message can carry it, in words safe to store and show.
    id_to_unpublishable_reason: dict[str, str] = field(default_factory=dict)
    unsent_ids: list[str] = field(default_factory=list)
    # The first broker error met, for the caller to raise once it has stored the rest.
    broker_error: KafkaError | None = None

    def raise_for_broker(self) -> None:
        """Raise if the broker left jobs unsent (call after `record_output` is committed)."""
        if self.broker_error is not None:
            raise RuntimeError(
                f"the broker did not take {len(self.unsent_ids)} job(s) ({self.broker_error}); "
                "they stay stale and the reconciler's next pass retries them"
            ) from self.broker_error


def publish_jobs(
    producer: KafkaProducer, settings: Settings, jobs: Sequence[Job | JobMessage], *,
    timeout_s: float,
) -> PublishOutput:
    """Send every job of the page and sort each into published, unpublishable or unsent.

    A job comes as its stored row or as its message already built (a fan-out's new rows).
    Raises nothing for a row's own fault or a broker failure; those are in the output.
    """
    output = PublishOutput()
    pending: list[tuple[str, FutureRecordMetadata]] = []
    for job in jobs:
        job_id = job.job_id if isinstance(job, JobMessage) else job.id
        if output.broker_error is not None:
            output.unsent_ids.append(job_id)  # the broker is gone: spare it the rest
            continue
        if job.model not in settings.served_models:
            # Sending would wait for a topic that does not exist, holding up the page.
            output.id_to_unpublishable_reason[job_id] = (
                f"model {job.model!r} is not served (served: {', '.join(settings.served_models)})"
            )
            continue
        try:
            message = job if isinstance(job, JobMessage) else job_message(job)
            pending.append((job_id, publish_job(producer, settings, message)))
        except RECORD_ERRORS as e:
            output.id_to_unpublishable_reason[job_id] = describe(e)
        except KafkaError as e:
            output.broker_error = e
            output.unsent_ids.append(job_id)
        except (ValueError, TypeError) as e:
            # Schema, priority and encoding errors (UnicodeEncodeError is a ValueError).
            output.id_to_unpublishable_reason[job_id] = describe(e)
    if pending:
        producer.flush(timeout=timeout_s)
    for job_id, future in pending:
        try:
            future.get(timeout=timeout_s)
        except RECORD_ERRORS as e:
            output.id_to_unpublishable_reason[job_id] = describe(e)
        except KafkaError as e:
            output.broker_error = output.broker_error or e
            output.unsent_ids.append(job_id)
        else:
            output.published_ids.append(job_id)
    for job_id, reason in output.id_to_unpublishable_reason.items():
        logger.warning("job %s cannot be published: %s", job_id, reason)
    return output


def record_output(session: Session, output: PublishOutput) -> list[Job]:
    """Stamp the published jobs and fail the unpublishable ones; the rows failed.

    A failed job's webhook is enqueued in the same transaction; the caller commits, then
    passes the rows to `count_failed`.
    """
    mark_published(session, job_ids=output.published_ids)
    failed: list[Job] = []
    for job_id, reason in output.id_to_unpublishable_reason.items():
        if not fail_job(session, job_id=job_id, error=unpublishable_error(reason)):
            continue  # finished or cancelled meanwhile
        job = get_job(session, job_id=job_id)
        if job is not None:
            enqueue_job_event(session, job=job)
            failed.append(job)
    return failed


def count_failed(jobs: list[Job]) -> None:
    """Count jobs failed as unpublishable (after their commit)."""
    metrics.JOBS_UNPUBLISHABLE.inc(len(jobs))
    for job in jobs:
        metrics.JOBS_FAILED.labels(job.priority).inc()


def unpublishable_error(reason: str) -> dict[str, Any]:
    """The stored error of a job no Kafka message can carry."""
    return {
        "message": f"the job could not be queued for a worker: {_printable(reason)}",
        "type": "invalid_request_error",
        "param": None,
        "code": "unpublishable",
    }


def describe(error: BaseException) -> str:
    """`Type: message`, with any unencodable character escaped so it can be stored.

    The error may quote the very text that could not be encoded (a lone surrogate); the
    stored reason must not carry it on.
    """
    return _printable(f"{type(error).__name__}: {error}")


def _printable(text: str) -> str:
    """`text` with every character UTF-8 cannot encode written as its escape (`\\ud800`)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
