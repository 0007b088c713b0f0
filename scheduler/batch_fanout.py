"""Fan-out: turning a validated batch's input lines into queued jobs, a chunk at a time.

Responsible for: reading the input file once per pass from the batch's cursor
(`num_enqueued`), and for each chunk of lines, in one transaction, locking the batch row,
checking it is still `in_progress` and its cursor is where this pass left it, adding the
jobs and advancing the cursor; then producing the jobs to their priority topic and
stamping them published. Memory holds one chunk.

Crash safety: a chunk's jobs and its cursor commit together, so a restarted pass resumes
at the first line without a job — no line is skipped or doubled. Jobs committed but not yet
produced stay `queued` with no publish stamp; the reconciler re-publishes them.
"""

from __future__ import annotations

import logging
import time
from itertools import islice

from kafka import KafkaProducer
from sqlalchemy.orm import Session, sessionmaker

from core import metrics
from core.settings import Settings
from scheduler.batch_input import ENDPOINT_TO_KIND, BatchRequest, iter_requests
from scheduler.job_publisher import count_failed, publish_jobs, record_output
from storage.batches import BatchStatus, lock_batch
from storage.files import FileStore
from storage.jobs import new_job
from storage.models import Job, JobStatus

logger = logging.getLogger(__name__)

# Lines turned into jobs per transaction (and per produce + flush).
CHUNK_SIZE = 500
# Seconds to wait for the broker to acknowledge one chunk.
PUBLISH_TIMEOUT_S = 30.0


def fan_out(
    settings: Settings, sessions: sessionmaker[Session], producer: KafkaProducer,
    store: FileStore, *, batch_id: str, budget_s: float,
) -> int:
    """Enqueue the batch's remaining lines for up to about `budget_s`; returns jobs added."""
    with sessions() as session:
        batch = lock_batch(session, batch_id=batch_id)
        if batch is None or batch.status != BatchStatus.IN_PROGRESS:
            return 0
        cursor, input_file_id = batch.num_enqueued, batch.input_file_id
        endpoint, model_override = batch.endpoint, batch.model_override
    deadline = time.monotonic() + budget_s
    num_added = 0
    with store.open(input_file_id) as handle:
        requests = iter_requests(handle, endpoint=endpoint, model_override=model_override,
                                 max_line_bytes=settings.max_request_bytes, skip=cursor,
                                 check_bodies=True, models_dir=settings.models_dir)
        while time.monotonic() < deadline:
            chunk = list(islice(requests, CHUNK_SIZE))
            if not chunk:
                break
            jobs = _add_chunk(sessions, batch_id=batch_id, cursor=cursor, chunk=chunk)
            if jobs is None:
                break
            if jobs:
                _publish(settings, sessions, producer, jobs)
            cursor += len(chunk)
            num_added += len(chunk)
    if num_added:
        logger.info("batch %s: enqueued %d job(s), %d so far", batch_id, num_added, cursor)
    return num_added


def _add_chunk(
    sessions: sessionmaker[Session], *, batch_id: str, cursor: int, chunk: list[BatchRequest]
) -> list[Job] | None:
    """Add one chunk's jobs and advance the cursor; the jobs to publish, None if the batch
    moved on meanwhile.

    A line the API would refuse (`BatchRequest.error`) is stored failed with that error, in
    the same transaction: it shows in the error file and never reaches a worker.
    """
    with sessions() as session:
        batch = lock_batch(session, batch_id=batch_id)
        if batch is None or batch.status != BatchStatus.IN_PROGRESS:
            return None
        if batch.num_enqueued != cursor:
            # Another pass (another scheduler) got here first; let it carry on.
            logger.info("batch %s: cursor moved from %d to %d elsewhere", batch_id, cursor,
                        batch.num_enqueued)
            return None
        kind = ENDPOINT_TO_KIND[batch.endpoint]
        jobs = [
            new_job(tenant_id=batch.tenant_id, priority=batch.priority, model=request.model,
                    kind=kind, request=request.body, callback_url=None, batch_id=batch.id,
                    custom_id=request.custom_id)
            for request in chunk
        ]
        refused = [job for job, r in zip(jobs, chunk, strict=True) if r.error]
        for job, request in zip(jobs, chunk, strict=True):
            if request.error:
                job.status, job.error, job.finished_at = (JobStatus.FAILED, request.error,
                                                          job.created_at)
        # Batch lines carry no idempotency key, so the chunk goes in as one multi-row
        # INSERT (a flush per job cost the scheduler most of its time per line).
        session.add_all(jobs)
        batch.num_enqueued = cursor + len(chunk)
        session.commit()
        if refused:
            metrics.JOBS_FAILED.labels(batch.priority).inc(len(refused))
            logger.info("batch %s: %d line(s) refused as the API would refuse them", batch_id,
                        len(refused))
        refused_ids = {job.id for job in refused}
        return [job for job in jobs if job.id not in refused_ids]


def _publish(settings: Settings, sessions: sessionmaker[Session], producer: KafkaProducer,
             jobs: list[Job]) -> None:
    """Produce the jobs, wait for the broker, and stamp them published.

    A line no message can carry fails as its own job; the rest of the chunk goes out.
    """
    output = publish_jobs(producer, settings, jobs, timeout_s=PUBLISH_TIMEOUT_S)
    with sessions() as session:
        failed = record_output(session, output)
        session.commit()
    count_failed(failed)
    output.raise_for_broker()

