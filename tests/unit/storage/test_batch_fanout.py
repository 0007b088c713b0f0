"""A fan-out chunk on SQLite: every line stored once as a job row, refused lines failed in
the same transaction, the messages to produce built from what was stored."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from scheduler.batch_fanout import _add_chunk
from scheduler.batch_input import BatchRequest
from storage.batches import BatchStatus, create_batch
from storage.files import create_file
from storage.job_messages import job_message
from storage.models import Job, JobStatus, Tenant, utcnow


@pytest.fixture
def batch_id(sessions: sessionmaker[Session], tenant: Tenant) -> str:
    """An embeddings batch in progress, nothing enqueued yet."""
    with sessions() as session:
        create_file(session, file_id="file-in", tenant_id=tenant.id, filename="in.jsonl",
                    purpose="batch", num_bytes=10)
        batch = create_batch(session, tenant_id=tenant.id, input_file_id="file-in",
                             endpoint="/v1/embeddings", completion_window="24h",
                             expires_at=utcnow() + timedelta(days=1), priority="low")
        batch.status = BatchStatus.IN_PROGRESS
        session.commit()
        return batch.id


def test_a_chunk_stores_every_line_and_fails_the_refused_ones(
    sessions: sessionmaker[Session], batch_id: str
) -> None:
    refusal = {"message": "input must not be empty", "param": "input"}
    chunk = [
        BatchRequest(line=1, custom_id="a", model="emb", body={"input": "first"}),
        BatchRequest(line=2, custom_id="b", model="emb", body={"input": ""}, error=refusal),
        BatchRequest(line=3, custom_id="c", model="emb", body={"input": ["x", "y"]}),
    ]
    added = _add_chunk(sessions, batch_id=batch_id, cursor=0, chunk=chunk)
    assert added is not None
    messages, num_lines = added
    assert num_lines == 3
    with sessions() as session:
        jobs = {job.custom_id: job for job in session.scalars(select(Job))}
        assert set(jobs) == {"a", "b", "c"}
        refused = jobs["b"]
        assert refused.status is JobStatus.FAILED and refused.error == refusal
        assert refused.finished_at == refused.created_at and refused.queued_at is None
        for custom_id, body in (("a", {"input": "first"}), ("c", {"input": ["x", "y"]})):
            job = jobs[custom_id]
            assert (job.status, job.kind, job.request, job.batch_id, job.priority) == (
                JobStatus.QUEUED, "embedding", body, batch_id, "low")
            assert job.error is None and job.result is None and job.attempts == 0
        # What goes to the broker is what a re-publish of the stored rows would send.
        assert messages == [job_message(jobs["a"]), job_message(jobs["c"])]
    assert all(m.attempt == 1 and m.has_callback is False for m in messages)


def test_a_chunk_behind_the_cursor_adds_nothing(
    sessions: sessionmaker[Session], batch_id: str
) -> None:
    line = BatchRequest(line=1, custom_id="a", model="emb", body={"input": "first"})
    assert _add_chunk(sessions, batch_id=batch_id, cursor=0, chunk=[line]) is not None
    # Another pass already moved the cursor past line 1: this one backs off.
    assert _add_chunk(sessions, batch_id=batch_id, cursor=0, chunk=[line]) is None
    with sessions() as session:
        assert len(session.scalars(select(Job)).all()) == 1
