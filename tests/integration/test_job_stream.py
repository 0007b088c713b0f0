"""A stream of short jobs through one worker at full speed: none stalls, none runs twice.

The engine is the tiny random-weight Llama with 1-token jobs, so what is exercised is the
service around it: the poll loop's pause/resume and prefetch bookkeeping under thousands
of records arriving in multi-record batches while the worker runs, the offset commits, and
the database writes. A worker that stops fetching while its partitions hold records (a
stall) fails the test by timing out.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter

import pytest
import sqlalchemy as sa

from storage.models import Job, JobStatus
from tests.utils.budget import within_budget
from tests.utils.worker_service import job_bodies

# Each test runs `batchinfer up` or a real model, several minutes on a loaded machine; its
# own waits end first, with their diagnostics.
pytestmark = pytest.mark.timeout(900)

NUM_JOBS = 5000
# Submitted in chunks of mixed priority while the worker runs, so records arrive during
# fetches, pauses and resumes, and every priority's partitions interleave.
CHUNK = 125
PRIORITIES = ("normal", "high", "low", "normal")


def test_five_thousand_short_jobs_of_mixed_priority_all_succeed_exactly_once(service) -> None:
    svc = service(worker_max_inflight=128, engine_max_num_seqs=64, topic_partitions=3)
    worker = svc.start_worker()
    job_ids: list[str] = []

    def produce() -> None:
        chunks = zip(range(NUM_JOBS // CHUNK), itertools.cycle(PRIORITIES), strict=False)
        for chunk_no, priority in chunks:
            bodies = job_bodies(CHUNK, tag=f"stream-{chunk_no}", max_tokens=1)
            job_ids.extend(svc.submit(priority, bodies, batched=True))

    producer = threading.Thread(target=produce, name="test-producer")
    producer.start()
    producer.join(within_budget(200))
    assert len(job_ids) == NUM_JOBS
    done = svc.wait_terminal(job_ids, timeout=500)
    statuses = Counter(job.status for job in done.values())
    assert statuses == {JobStatus.SUCCEEDED: NUM_JOBS}, statuses
    assert all(job.result is not None for job in done.values())
    # Exactly once: each job claimed once (attempts counts claims) and stored once.
    with svc.sessions() as session:
        claims = session.scalars(sa.select(Job.attempts).where(Job.id.in_(job_ids))).all()
    assert Counter(claims) == {1: NUM_JOBS}
    assert worker.process.poll() is None, worker.log_tail()
    assert "fetch stall" not in worker.log_tail(10**7)


def test_a_job_claimed_job_max_attempts_times_fails_instead_of_running_again(service) -> None:
    """Its workers kept dying on it: a poison pill, failed with the reason, not retried."""
    svc = service(job_max_attempts=2)
    poison, fine = svc.submit("normal", job_bodies(2, tag="poison", max_tokens=1))
    with svc.sessions() as session:
        session.execute(sa.update(Job).where(Job.id == poison).values(attempts=2))
        session.commit()
    svc.start_worker()
    done = svc.wait_terminal([poison, fine])
    assert done[poison].status == JobStatus.FAILED
    assert done[poison].error["code"] == "worker_lost"
    assert done[poison].attempts == 2
    assert done[fine].status == JobStatus.SUCCEEDED
