"""Idempotent status writes: the first finisher wins, every later or racing write is a no-op."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest
from sqlalchemy.orm import Session, sessionmaker

from storage.jobs import cancel_job, complete_job, create_job, fail_job, get_job, mark_running
from storage.models import Job, JobStatus, Tenant

# Seconds the racers wait for each other at the start line: far above a loaded start.
BARRIER_TIMEOUT_S = 60.0


def queued_job(sessions: sessionmaker[Session], tenant: Tenant) -> str:
    """Commit a queued job and return its id."""
    with sessions() as session:
        job = create_job(
            session,
            tenant_id=tenant.id,
            priority="low",
            model="m",
            kind="text_completion",
            request={"prompt": "hi"},
        )
        session.commit()
        return job.id


def complete(session: Session, job_id: str, text: str) -> bool:
    """complete_job with a small text_completion result."""
    return complete_job(
        session,
        job_id=job_id,
        result={"choices": [{"text": text}]},
        prompt_tokens=3,
        completion_tokens=5,
        cached_tokens=1,
        first_token_at=datetime.now(UTC),
    )


def load(sessions: sessionmaker[Session], job_id: str) -> Job:
    """The job as committed, read in a fresh session."""
    with sessions() as session:
        job = get_job(session, job_id=job_id)
        assert job is not None
        return job


def test_complete_after_cancel_does_nothing(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    job_id = queued_job(sessions, tenant)
    with sessions() as worker:
        assert mark_running(worker, job_id=job_id, worker_id="w1")
        worker.commit()
        # The worker holds a loaded copy that still says running.
        assert get_job(worker, job_id=job_id).status is JobStatus.RUNNING  # type: ignore[union-attr]
        with sessions() as api:
            cancelled = cancel_job(api, job_id=job_id, tenant_id=tenant.id)
            api.commit()
            assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
        assert not complete(worker, job_id, "late")
        assert not fail_job(worker, job_id=job_id, error={"message": "late"})
        worker.commit()
    job = load(sessions, job_id)
    assert job.status is JobStatus.CANCELLED
    assert job.result is None and job.error is None and job.completion_tokens is None
    assert job.finished_at is not None


def test_cancel_after_complete_returns_the_finished_job(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    job_id = queued_job(sessions, tenant)
    with sessions() as session:
        mark_running(session, job_id=job_id, worker_id="w1")
        assert complete(session, job_id, "done")
        session.commit()
        job = cancel_job(session, job_id=job_id, tenant_id=tenant.id)
        session.commit()
        assert job is not None and job.status is JobStatus.SUCCEEDED
        assert job.result == {"choices": [{"text": "done"}]}


def test_second_result_write_keeps_the_first(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    job_id = queued_job(sessions, tenant)
    with sessions() as session:
        mark_running(session, job_id=job_id, worker_id="w1")
        assert complete(session, job_id, "first")
        assert not complete(session, job_id, "second")
        assert not fail_job(session, job_id=job_id, error={"message": "x"})
        assert not mark_running(session, job_id=job_id, worker_id="w2")
        session.commit()
    job = load(sessions, job_id)
    assert job.status is JobStatus.SUCCEEDED
    assert job.result == {"choices": [{"text": "first"}]}
    assert (job.prompt_tokens, job.completion_tokens, job.cached_tokens) == (3, 5, 1)
    assert job.worker_id == "w1" and job.attempts == 1


def test_redelivered_job_is_reclaimed_and_counted(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    job_id = queued_job(sessions, tenant)
    with sessions() as session:
        assert mark_running(session, job_id=job_id, worker_id="w1")
        session.commit()
        first_start = get_job(session, job_id=job_id).started_at  # type: ignore[union-attr]
        assert mark_running(session, job_id=job_id, worker_id="w2")
        session.commit()
    job = load(sessions, job_id)
    assert job.status is JobStatus.RUNNING
    assert job.attempts == 2 and job.worker_id == "w2"
    assert first_start is not None and job.started_at is not None
    assert job.started_at >= first_start


def test_queued_job_can_complete_directly_and_gets_a_start_time(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    job_id = queued_job(sessions, tenant)
    with sessions() as session:
        assert complete(session, job_id, "from cache")
        session.commit()
    job = load(sessions, job_id)
    assert job.status is JobStatus.SUCCEEDED
    assert job.started_at is not None and job.finished_at is not None
    assert job.started_at <= job.finished_at


def test_queued_job_can_fail_or_be_cancelled(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    failed, cancelled = queued_job(sessions, tenant), queued_job(sessions, tenant)
    with sessions() as session:
        assert fail_job(session, job_id=failed, error={"message": "model not served"})
        job = cancel_job(session, job_id=cancelled, tenant_id=tenant.id)
        session.commit()
        assert job is not None and job.status is JobStatus.CANCELLED
    assert load(sessions, failed).error == {"message": "model not served"}
    assert load(sessions, failed).status is JobStatus.FAILED


def test_missing_job_writes_report_false(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        assert not mark_running(session, job_id="job_missing", worker_id="w")
        assert not complete(session, "job_missing", "x")
        assert not fail_job(session, job_id="job_missing", error={})


@pytest.mark.parametrize("num_cancellers", [0, 2])
def test_concurrent_finishers_have_exactly_one_winner(
    sessions: sessionmaker[Session], tenant: Tenant, num_cancellers: int
) -> None:
    num_completers = 6
    job_id = queued_job(sessions, tenant)
    with sessions() as session:
        mark_running(session, job_id=job_id, worker_id="w0")
        session.commit()
    start = threading.Barrier(num_completers + num_cancellers)
    completed: dict[int, bool] = {}

    def completer(i: int) -> None:
        with sessions() as session:
            start.wait(BARRIER_TIMEOUT_S)  # a thread that died first breaks it
            completed[i] = complete(session, job_id, f"writer {i}")
            session.commit()

    def canceller() -> None:
        with sessions() as session:
            start.wait(BARRIER_TIMEOUT_S)  # a thread that died first breaks it
            cancel_job(session, job_id=job_id, tenant_id=tenant.id)
            session.commit()

    threads = [threading.Thread(target=completer, args=(i,)) for i in range(num_completers)]
    threads += [threading.Thread(target=canceller) for _ in range(num_cancellers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * BARRIER_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a racer hung"

    assert len(completed) == num_completers
    winners = [i for i, changed in completed.items() if changed]
    job = load(sessions, job_id)
    if job.status is JobStatus.SUCCEEDED:
        assert len(winners) == 1
        assert job.result == {"choices": [{"text": f"writer {winners[0]}"}]}
    else:
        assert num_cancellers and job.status is JobStatus.CANCELLED
        assert winners == [] and job.result is None
