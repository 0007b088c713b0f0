"""Fair share between tenants on the real stack: API, scheduler, one worker, broker, DB.

Tenant A's 60-line batch is running when tenant B submits 4 jobs of the same priority.
The batch's fan-out keeps at most `batch_max_queued_lines` (6) of its lines queued, and
the worker's intake alternates tenants within a priority. Once B's last job is submitted,
at most 6 of A's lines are ahead of it; while the worker drains those on B's partition
it also runs A's newer lines from the other partition, so B's jobs all start after at
most partitions x 6 of A's lines plus one per B job, not after the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import sqlalchemy as sa

from storage.models import Job, JobStatus
from tests.utils.api import make_tenant_key
from tests.utils.batch_service import CHAT, TERMINAL, BatchService, chat_line, jsonl

WINDOW = 6
NUM_B_JOBS = 4


def test_another_tenants_jobs_are_not_queued_behind_a_whole_batch(
        batch_services: Callable[..., BatchService]) -> None:
    svc = batch_services(batch_max_queued_lines=WINDOW, worker_max_inflight=2,
                  engine_max_num_seqs=2)
    model = svc.settings.model
    client = svc.openai()
    lines = [chat_line(f"a-{i}", model, content=f"Batch question number {i}?")
             for i in range(60)]
    uploaded = client.files.create(file=("a.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                  completion_window="24h", extra_body={"priority": "low"})
    svc.wait_batch(client, batch.id, lambda b: b.request_counts is not None
                   and b.request_counts.completed >= 4)
    with svc.sessions() as session:  # the window holds: never more than WINDOW queued
        num_queued = session.scalar(sa.select(sa.func.count()).select_from(Job).where(
            Job.batch_id == batch.id, Job.status == JobStatus.QUEUED))
    assert num_queued is not None and num_queued <= WINDOW

    b = make_tenant_key(svc.sessions, "tenant-b")
    with httpx.Client(base_url=svc.url, headers=b.headers, timeout=30) as http:
        b_ids = []
        for i in range(NUM_B_JOBS):
            response = http.post("/v1/jobs", json={
                "model": model, "priority": "low", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": f"Tenant B asks {i}"}]})
            assert response.status_code == 202, response.text
            b_ids.append(response.json()["id"])
    done = svc.wait_batch(client, batch.id, lambda b: b.status in TERMINAL)
    assert done.status == "completed", svc.logs()
    deadline = time.monotonic() + 60
    while True:
        with svc.sessions() as session:
            b_jobs = session.scalars(sa.select(Job).where(Job.id.in_(b_ids))).all()
            if all(j.status == JobStatus.SUCCEEDED for j in b_jobs):
                break
        assert time.monotonic() < deadline, svc.logs()
        time.sleep(0.2)
    submitted_at = max(j.created_at for j in b_jobs)
    last_b_start = max(j.started_at for j in b_jobs if j.started_at is not None)
    with svc.sessions() as session:
        num_a_between = session.scalar(sa.select(sa.func.count()).select_from(Job).where(
            Job.batch_id == batch.id, Job.started_at > submitted_at,
            Job.started_at < last_b_start))
        num_a_after = session.scalar(sa.select(sa.func.count()).select_from(Job).where(
            Job.batch_id == batch.id, Job.started_at >= last_b_start))
    # The window's lines on each partition, then one A start per B start.
    bound = svc.settings.topic_partitions * WINDOW + NUM_B_JOBS
    assert num_a_between is not None and num_a_between <= bound, svc.logs()
    assert num_a_after is not None and num_a_after > 0  # B did not wait for the batch
