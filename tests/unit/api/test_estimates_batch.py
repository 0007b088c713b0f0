"""A batch's ETA through the estimate board, on a real SQLite file: the batch's jobs are
placed as the board's reading holds them, whatever has been enqueued since it was read."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.estimates import EstimateBoard
from storage.batches import Batch, BatchStatus, create_batch
from storage.estimates import BatchLeft, read_batch_left
from storage.jobs import create_job
from storage.models import Job, JobStatus, utcnow
from storage.tenants import create_tenant
from storage.workers import record_heartbeat

NUM_LINES = 100
# No job has finished: each is worth the defaults, 64 prompt + 128 output tokens.
WORK_PER_JOB = 64 + 128


def in_progress_batch(session: Session, tenant_id: str) -> Batch:
    batch = create_batch(session, tenant_id=tenant_id, input_file_id="file-x",
                         endpoint="/v1/chat/completions", completion_window="24h",
                         expires_at=utcnow() + timedelta(hours=24), priority="normal")
    batch.model, batch.num_requests = "m", NUM_LINES
    batch.move_to(BatchStatus.IN_PROGRESS)
    return batch


def fan_out(session: Session, batch: Batch, num_lines: int) -> None:
    """Enqueue the batch's next lines as the fan-out does: jobs and cursor together."""
    for _ in range(num_lines):
        create_job(session, tenant_id=batch.tenant_id, priority="normal", model="m",
                   kind="chat.completion", request={"model": "m", "messages": []},
                   batch_id=batch.id, deadline=batch.expires_at)
    batch.num_enqueued += num_lines
    session.commit()


def eta(board: EstimateBoard, sessions: sessionmaker[Session], batch: Batch) -> float:
    def read_left() -> BatchLeft:
        with sessions() as session:
            return read_batch_left(session.connection(), batch_id=batch.id)

    at = board.batch_completion(model="m", priority="normal", batch_id=batch.id,
                                deadline=batch.expires_at, read_left=read_left)
    assert at is not None
    return at - utcnow().timestamp()


def test_lines_enqueued_since_the_reading_count_whole(sessions: sessionmaker[Session]) -> None:
    """An idle worker at 1,000 tokens/s, 10 ms a step; a batch of 100 lines of 192 tokens
    needs ~19.2 s, before its fan-out, right after it (the board's reading older than its
    jobs) and once the board has read them. Placing the batch's fresh count of queued
    jobs in a reading that did not hold them put its last job first in line: one job's
    own run, 128 x 10 ms = 1.3 s."""
    with sessions() as session:
        tenant = create_tenant(session, name="acme")
        record_heartbeat(session, worker_id="w", model="m", tokens_per_s=1000.0, step_s=0.01,
                         num_requests_left=0, num_tokens_to_compute=0,
                         num_output_tokens_left=0)
        batch = in_progress_batch(session, tenant.id)
        session.commit()
        board = EstimateBoard(sessions.kw["bind"], refresh_s=3600.0, heartbeat_timeout_s=60.0)
        expected = NUM_LINES * WORK_PER_JOB / 1000.0
        # The first job's own run (1.28 s) is longer than its work at the pace (0.19 s).
        slack = 128 * 0.01
        # (less the moments between the estimate and its check)
        assert expected - 0.05 <= eta(board, sessions, batch) <= expected + slack
        fan_out(session, batch, 40)  # the reading is an hour from stale: it holds none
        assert expected - 0.05 <= eta(board, sessions, batch) <= expected + slack
        fan_out(session, batch, NUM_LINES - 40)
        assert expected - 0.05 <= eta(board, sessions, batch) <= expected + slack
        board.refresh()  # now it holds them all, queued
        assert eta(board, sessions, batch) == pytest.approx(expected, abs=0.1)


def test_a_reading_of_the_batch_counts_what_it_holds_once(
        sessions: sessionmaker[Session]) -> None:
    """The reading holds 60 of the batch's jobs queued and 40 running (a worker reports
    their 4,000 tokens left); since, 20 of the running ones finished: 60 x 192 + 4,000
    tokens are left, not the 80 unfinished jobs on top of them."""
    with sessions() as session:
        tenant = create_tenant(session, name="acme")
        batch = in_progress_batch(session, tenant.id)
        fan_out(session, batch, NUM_LINES)
        running = list(session.scalars(
            select(Job).where(Job.batch_id == batch.id).order_by(Job.created_at)))[:40]
        for job in running:
            job.status, job.worker_id = JobStatus.RUNNING, "w"
            job.started_at = utcnow() - timedelta(seconds=10)
        # Beat last: the reading is then as old as its report.
        beat_at = utcnow()
        record_heartbeat(session, worker_id="w", model="m", now=beat_at, tokens_per_s=1000.0,
                         step_s=0.01, num_requests_left=40, num_tokens_to_compute=4000,
                         num_output_tokens_left=2000)
        session.commit()
        board = EstimateBoard(sessions.kw["bind"], refresh_s=3600.0, heartbeat_timeout_s=60.0)
        before = eta(board, sessions, batch)
        # The reading takes what the pace did since the beat off the report.
        since_s = (utcnow() - beat_at).total_seconds()
        expected = (60 * WORK_PER_JOB + 4000) / 1000.0
        assert expected - since_s - 0.01 <= before <= expected + 0.01
        for job in running[:20]:
            job.status = JobStatus.SUCCEEDED
        session.commit()
        assert eta(board, sessions, batch) == pytest.approx(before, abs=0.1)
