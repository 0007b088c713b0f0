"""Results of many jobs stored with one statement, and what it says when a job raced it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy
from sqlalchemy.orm import Session, sessionmaker

from storage.job_batches import Completion, claim_jobs, complete_jobs
from storage.jobs import cancel_job, create_job, get_job, mark_published, release_jobs
from storage.models import JobStatus, Tenant


def check_complete_jobs(sessions: sessionmaker[Session], tenant: Tenant) -> None:
    """Queued and running jobs all finish in one call with their own results; a batch with
    a cancelled job reports None and the caller's rollback leaves every job as it was.
    Shared by the SQLite test here and the PostgreSQL one in tests/integration."""
    with sessions() as session:
        ids = [create_job(session, tenant_id=tenant.id, priority="low", model="m",
                          kind="embedding", request={"input": f"text {i}"}).id
               for i in range(5)]
        session.commit()
        assert claim_jobs(session, job_ids=ids[:3], worker_id="w1") == set(ids[:3])
        session.commit()
    first_token_at = datetime.now(UTC)
    completions = [Completion(job_id, {"data": [{"embedding": [0.5, -1.25, i]}]}, 10 + i, 0,
                              i, first_token_at if i % 2 else None)
                   for i, job_id in enumerate(ids)]
    with sessions() as session:
        assert complete_jobs(session, completions) == set(ids)
        session.commit()
    with sessions() as session:
        for i, job_id in enumerate(ids):
            job = get_job(session, job_id=job_id)
            assert job is not None and job.status is JobStatus.SUCCEEDED
            assert job.result == {"data": [{"embedding": [0.5, -1.25, i]}]}
            assert (job.prompt_tokens, job.completion_tokens, job.cached_tokens) == (10 + i, 0, i)
            assert job.first_token_at == (first_token_at if i % 2 else None)
            assert job.error is None and job.started_at is not None
            assert job.finished_at is not None and job.started_at <= job.finished_at
        # A second write of the same results changes nothing: every job is finished.
        assert complete_jobs(session, completions) is None
        session.rollback()

    with sessions() as session:
        more = [create_job(session, tenant_id=tenant.id, priority="low", model="m",
                           kind="embedding", request={"input": "x"}).id for _ in range(3)]
        session.commit()
        assert cancel_job(session, job_id=more[1], tenant_id=tenant.id) is not None
        session.commit()
        assert complete_jobs(session, [Completion(job_id, {"n": 1}, 1, 0, 0, None)
                                       for job_id in more]) is None
        session.rollback()
    with sessions() as session:
        statuses = [job.status for job_id in more if (job := get_job(session, job_id=job_id))]
        assert statuses == [JobStatus.QUEUED, JobStatus.CANCELLED, JobStatus.QUEUED]
        assert complete_jobs(session, []) == set()


def test_complete_jobs_on_sqlite(sessions: sessionmaker[Session], tenant: Tenant) -> None:
    """See check_complete_jobs."""
    check_complete_jobs(sessions, tenant)


def test_statements_over_listed_jobs_find_them_by_id(
    engine: sqlalchemy.Engine, sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    """A claim, a publish stamp and a hand-back of 56 listed jobs look them up by primary
    key on SQLite: served from the status index, each read every queued job's entry,
    growing with the backlog (35 ms a claim behind 50,000 queued jobs)."""
    with sessions() as session:
        ids = [create_job(session, tenant_id=tenant.id, priority="low", model="m",
                          kind="embedding", request={"input": f"text {i}"}).id
               for i in range(200)]
        session.commit()
    updates: list[tuple[str, Any]] = []

    def remember(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
                 executemany: bool) -> None:
        if statement.startswith("UPDATE jobs"):
            updates.append((statement, parameters))

    sqlalchemy.event.listen(engine, "before_cursor_execute", remember)
    listed = ids[:56]
    with sessions() as session:
        mark_published(session, job_ids=listed)
        assert claim_jobs(session, job_ids=listed, worker_id="w1") == set(listed)
        assert sorted(release_jobs(session, job_ids=listed, worker_id="w1")) == sorted(listed)
        session.commit()
    sqlalchemy.event.remove(engine, "before_cursor_execute", remember)
    assert len(updates) == 3
    with engine.connect() as connection:
        for statement, parameters in updates:
            plan = [row[3] for row in connection.exec_driver_sql(
                "EXPLAIN QUERY PLAN " + statement, parameters)]
            assert plan == ["SEARCH jobs USING INDEX sqlite_autoindex_jobs_1 (id=?)"], statement
