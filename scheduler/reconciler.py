"""Re-publish jobs that stayed `queued` too long.

Responsible for: finding queued jobs whose last publish (or creation, when never
published) is older than `settings.requeue_after_s`, producing them again to their priority
topic, and restamping them as published only once the broker acknowledged them.

The database is the source of truth and the broker may lose messages (the embedded broker
keeps them in memory only; a producer may crash between the database commit and the
send). A job re-published while its first copy still waits in the topic runs once all the
same: workers skip redelivered jobs that are already finished.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from kafka import KafkaProducer
from sqlalchemy.orm import Session, sessionmaker

from core.kafka import publish_job
from core.messages import JobMessage
from core.settings import Settings
from storage.jobs import mark_published, stale_queued_jobs
from storage.models import Job, utcnow

logger = logging.getLogger(__name__)

# Jobs read, produced and restamped per round trip.
PAGE_SIZE = 500
# Seconds to wait for the broker to acknowledge one page.
PUBLISH_TIMEOUT_S = 30.0


def job_message(job: Job) -> JobMessage:
    """The Kafka message that carries a stored job."""
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
    )


class Reconciler:
    """Finds stale queued jobs and produces them again."""

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        producer: KafkaProducer,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.producer = producer

    @property
    def interval_s(self) -> float:
        """Seconds between periodic passes: half the staleness limit, at most a minute."""
        return min(60.0, self.settings.requeue_after_s / 2)

    def republish_stale(self, *, older_than: datetime | None = None) -> int:
        """Re-publish every queued job last published before older_than; returns how many.

        older_than defaults to now − requeue_after_s. At start-up pass now, so everything
        left queued by an earlier run goes out again.
        """
        cutoff = older_than or utcnow() - timedelta(seconds=self.settings.requeue_after_s)
        num_republished = 0
        while True:
            with self.sessions() as session:
                jobs = stale_queued_jobs(session, older_than=cutoff, limit=PAGE_SIZE)
                if not jobs:
                    break
                self._publish(jobs)
                # Restamped jobs are no longer older than the cutoff, so the next page
                # holds only jobs not yet seen.
                mark_published(session, job_ids=[job.id for job in jobs])
                session.commit()
            num_republished += len(jobs)
            if len(jobs) < PAGE_SIZE:
                break
        if num_republished:
            logger.info("re-published %d queued job(s) older than %s", num_republished,
                        cutoff.isoformat())
        return num_republished

    def _publish(self, jobs: list[Job]) -> None:
        futures = [publish_job(self.producer, self.settings, job_message(job)) for job in jobs]
        self.producer.flush(timeout=PUBLISH_TIMEOUT_S)
        for future in futures:
            # Raises the broker's error; the jobs stay stale and the next pass retries.
            future.get(timeout=PUBLISH_TIMEOUT_S)

