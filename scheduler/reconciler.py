"""Put every unfinished job back in reach of a worker: orphaned running jobs, stale queued ones.

Responsible for, once per pass:
- orphans: `running` jobs whose worker stopped heart-beating (crashed, hung, or left
  without handing them back; see `storage.workers`). Each goes back to `queued` and is
  re-published at once, or, when it has had `job_max_attempts` claims already, fails
  with the reason (`code` `worker_lost`): a job that kills every worker it lands on must
  not do so forever. Both writes are one guarded UPDATE per dead worker (status running,
  worker_id still that worker, heartbeat still stale), so a job finished, cancelled or
  claimed by a live worker meanwhile is left alone, and two reconcilers cannot both act.
  A worker of this host whose process is gone is dead at once, not after the heartbeat
  timeout (`core.worker_ids`): after a crash or a restart of the whole stack its jobs
  go back in the first pass;
- stale queued jobs: last published (or created, if never) before `requeue_after_s`
  ago, produced again to their priority topic and restamped once the broker has them.

The database is the source of truth and the broker may lose messages (the embedded broker
keeps them in memory only; a producer may crash between the database commit and the
send). A job re-published while its first copy still waits in the topic runs once all the
same: workers skip redelivered jobs that are already finished.

A row that can never become a message (see `scheduler.job_publisher`) is failed with the
reason and the rest of its page goes out; a broker failure ends the pass after the page's
published and failed rows are stored, and the next pass retries the others.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

import redis
from kafka import KafkaProducer
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core import metrics
from core.settings import Settings
from core.worker_ids import is_known_dead
from scheduler.job_publisher import count_failed, publish_jobs, record_output
from storage.events import publish_cancel, publish_job_done
from storage.jobs import (
    expire_past_deadline,
    fail_orphaned_jobs,
    get_job,
    requeue_orphaned_jobs,
    stale_queued_jobs,
)
from storage.models import Job, JobStatus, utcnow
from storage.webhook_events import enqueue_job_event
from storage.workers import orphaned_jobs, prune_dead_workers, remove_workers, worker_ids

logger = logging.getLogger(__name__)

# Jobs read, produced and restamped per round trip.
PAGE_SIZE = 500
# Seconds to wait for the broker to acknowledge one page.
PUBLISH_TIMEOUT_S = 30.0


class Reconciler:
    """Hands orphaned running jobs back, fails spent ones, and re-publishes stale ones."""

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        producer: KafkaProducer,
        *,
        redis_client: redis.Redis | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.producer = producer
        # Wakes long-polls on the jobs this reconciler fails; without it they time out.
        self.redis_client = redis_client

    @property
    def interval_s(self) -> float:
        """Seconds between passes: half the staleness limit or heartbeat timeout, ≤ 1 min."""
        return min(60.0, self.settings.requeue_after_s / 2,
                   self.settings.worker_heartbeat_timeout_s / 2)

    def republish_stale(self, *, older_than: datetime | None = None) -> int:
        """One pass (orphans, then stale queued jobs); returns the jobs re-published.

        older_than bounds the queued jobs re-published and defaults to now −
        requeue_after_s. At start-up pass now, so everything left queued by an earlier run
        goes out again. Orphans are judged by the heartbeat timeout either way.
        """
        self.expire_past_deadline()
        num_republished = self.reclaim_orphans()
        cutoff = older_than or utcnow() - timedelta(seconds=self.settings.requeue_after_s)
        num_stale = 0
        while True:
            with self.sessions() as session:
                jobs = stale_queued_jobs(session, older_than=cutoff, limit=PAGE_SIZE)
                if not jobs:
                    break
                # Published rows are restamped and failed ones are no longer queued, so
                # the next page holds only jobs not yet seen.
                num_stale += self._publish_page(session, jobs)
            if len(jobs) < PAGE_SIZE:
                break
        if num_stale:
            logger.info("re-published %d queued job(s) older than %s", num_stale,
                        cutoff.isoformat())
        return num_republished + num_stale

    def expire_past_deadline(self) -> int:
        """Expire jobs still unfinished at their deadline; abort the running ones in their
        workers, wake their long-polls and send their webhooks. Returns how many."""
        total = 0
        while True:
            with self.sessions() as session:
                expired = expire_past_deadline(session, now=utcnow(), limit=PAGE_SIZE)
                for job, _ in expired:
                    enqueue_job_event(session, job=job)
                session.commit()
                jobs = [(job.id, job.priority, was_running) for job, was_running in expired]
            for job_id, priority, was_running in jobs:
                metrics.JOBS_EXPIRED.labels(priority).inc()
                if self.redis_client is None:
                    continue
                if was_running:
                    publish_cancel(self.redis_client, prefix=self.settings.topic_prefix,
                                   job_id=job_id)
                publish_job_done(self.redis_client, prefix=self.settings.topic_prefix,
                                 job_id=job_id, status=JobStatus.EXPIRED)
            total += len(jobs)
            if len(jobs) < PAGE_SIZE:
                break
        if total:
            logger.info("expired %d job(s) past their deadline", total)
        return total

    def reclaim_orphans(self) -> int:
        """Requeue and re-publish (or fail) running jobs of dead workers; returns re-published."""
        dead_before = utcnow() - timedelta(seconds=self.settings.worker_heartbeat_timeout_s)
        self._forget_known_dead()
        num_republished = 0
        while True:
            with self.sessions() as session:
                orphans = orphaned_jobs(session, dead_before=dead_before, limit=PAGE_SIZE)
                if not orphans:
                    break
                requeued_ids, failed = self._hand_back(session, orphans, dead_before)
                prune_dead_workers(session, dead_before=dead_before)
                session.commit()
            for job in failed:
                metrics.JOBS_FAILED.labels(job.priority).inc()
            self._wake_waiters(failed)
            if requeued_ids:
                with self.sessions() as session:
                    jobs = list(session.scalars(
                        select(Job).where(Job.id.in_(requeued_ids),
                                          Job.status == JobStatus.QUEUED)
                        .order_by(Job.created_at, Job.id)
                    ))
                    num_republished += self._publish_page(session, jobs) if jobs else 0
            # Rows not moved were claimed by a live worker meanwhile; they are not
            # orphans any more, so the next read moves on.
            if len(orphans) < PAGE_SIZE or not (requeued_ids or failed):
                break
        return num_republished

    def _forget_known_dead(self) -> None:
        """Delete the rows of this host's workers whose process is gone (a crash, a kill,
        the whole stack restarted), so their jobs are orphans now, not after the timeout."""
        with self.sessions() as session:
            dead = [w for w in worker_ids(session) if is_known_dead(w)]
            if dead:
                remove_workers(session, worker_ids=dead)
                session.commit()
        if dead:
            logger.warning("worker(s) %s are gone (no such process); handing their jobs "
                           "back now", ", ".join(dead))

    def _hand_back(
        self, session: Session, orphans: list[Job], dead_before: datetime
    ) -> tuple[list[str], list[Job]]:
        """Requeue or fail the orphans, one guarded UPDATE each per dead worker.

        Returns the ids requeued and the jobs failed.
        """
        worker_to_job_ids: dict[str | None, list[str]] = defaultdict(list)
        for job in orphans:
            worker_to_job_ids[job.worker_id].append(job.id)
        max_attempts = self.settings.job_max_attempts
        requeued_ids: list[str] = []
        failed_ids: list[str] = []
        for worker_id, job_ids in worker_to_job_ids.items():
            failed = fail_orphaned_jobs(
                session, job_ids=job_ids, worker_id=worker_id, dead_before=dead_before,
                max_attempts=max_attempts, error=worker_lost_error(max_attempts),
            )
            requeued = requeue_orphaned_jobs(
                session, job_ids=job_ids, worker_id=worker_id, dead_before=dead_before,
                max_attempts=max_attempts,
            )
            if failed or requeued:
                logger.warning(
                    "worker %s silent since before %s: %d running job(s) back to the "
                    "queue, %d failed after their last attempt", worker_id,
                    dead_before.isoformat(), len(requeued), len(failed),
                )
            requeued_ids += requeued
            failed_ids += failed
        failed_jobs = [row for job_id in failed_ids
                       if (row := self._enqueue_webhook(session, job_id)) is not None]
        metrics.JOBS_RECLAIMED.labels("requeued").inc(len(requeued_ids))
        metrics.JOBS_RECLAIMED.labels("failed").inc(len(failed_ids))
        return requeued_ids, failed_jobs

    def _publish_page(self, session: Session, jobs: list[Job]) -> int:
        """Produce the page, restamp what the broker has, fail what it never can; commit.

        Returns how many were published; raises the broker's error (after the commit) if
        some were not acknowledged.
        """
        output = publish_jobs(self.producer, self.settings, jobs, timeout_s=PUBLISH_TIMEOUT_S)
        failed = record_output(session, output)
        session.commit()
        count_failed(failed)
        self._wake_waiters(failed)
        output.raise_for_broker()
        return len(output.published_ids)

    def _enqueue_webhook(self, session: Session, job_id: str) -> Job | None:
        """Enqueue the failed job's webhook in this transaction; the row, None if gone."""
        job = get_job(session, job_id=job_id)
        if job is not None:
            enqueue_job_event(session, job=job)
        return job

    def _wake_waiters(self, jobs: list[Job]) -> None:
        """Wake long-polls waiting on jobs failed here (after their commit)."""
        if self.redis_client is None:
            return
        for job in jobs:
            publish_job_done(self.redis_client, prefix=self.settings.topic_prefix,
                             job_id=job.id, status=JobStatus.FAILED)


def worker_lost_error(max_attempts: int) -> dict[str, Any]:
    """The stored error of a job whose worker died on its last allowed attempt."""
    return {
        "message": f"the worker running this job stopped before finishing it, and the job "
                   f"has had its {max_attempts} attempt(s) (job_max_attempts): not retried",
        "type": "server_error",
        "param": None,
        "code": "worker_lost",
    }

