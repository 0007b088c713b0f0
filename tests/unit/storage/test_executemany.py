"""A statement run for many rows through the driver stores what SQLAlchemy's own
executemany stores: every value through its type's processor, literal values and shared
values alike."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Table, bindparam, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from storage.executemany import ManyStatement
from storage.jobs import create_job
from storage.models import Job, JobStatus, Tenant, UTCDateTime

TABLE: Table = Job.__table__  # type: ignore[assignment]  # a Table, typed as FromClause


def _statement(**values: Any) -> Any:
    """Results, token counts and times written by id, with a literal status and a value
    (`b_at`) the rows share, used twice."""
    at = bindparam("b_at", type_=UTCDateTime())
    return (
        update(TABLE)
        .where(TABLE.c.id == bindparam("b_id"), TABLE.c.status == JobStatus.QUEUED)
        .values(status=JobStatus.SUCCEEDED, result=bindparam("b_result"),
                prompt_tokens=bindparam("b_tokens"), first_token_at=bindparam("b_first"),
                started_at=func.coalesce(TABLE.c.started_at, at), finished_at=at, **values)
    )


def _stored(session: Session, ids: list[str]) -> list[tuple[Any, ...]]:
    rows = session.execute(select(
        Job.id, Job.status, Job.result, Job.prompt_tokens, Job.first_token_at, Job.started_at,
        Job.finished_at, Job.error).where(Job.id.in_(ids)).order_by(Job.prompt_tokens))
    return [tuple(row[1:]) for row in rows]


def check_many_statement_stores_what_sqlalchemy_stores(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    """Shared by the SQLite test here and the PostgreSQL one in tests/integration."""
    with sessions() as session:
        ids = [create_job(session, tenant_id=tenant.id, priority="low", model="m",
                          kind="embedding", request={"input": f"text {i}"}).id for i in range(8)]
        session.commit()
    at = datetime(2026, 11, 27, 21, 0, 0, 123456, tzinfo=UTC)
    first = datetime.now(UTC) - timedelta(hours=3)

    def rows(part: list[str]) -> list[dict[str, Any]]:
        # JSON with text UTF-8 and SQL quoting alike must keep, nulls, aware datetimes.
        return [{"b_id": job_id, "b_result": {"text": f"it's «{i}» 日本", "n": [i, None, 0.5]},
                 "b_tokens": 10 * i, "b_first": first if i % 2 else None}
                for i, job_id in enumerate(part)]

    many = ManyStatement(_statement())
    with sessions() as session:
        assert many.run(session, rows(ids[:4]), shared={"b_at": at}) == 4
        session.execute(_statement(), [{**row, "b_at": at} for row in rows(ids[4:])])
        # Only queued rows match: a second run changes nothing, and says so.
        assert many.run(session, rows(ids[:4]), shared={"b_at": at}) == 0
        session.commit()
    with sessions() as session:
        ours, theirs = _stored(session, ids[:4]), _stored(session, ids[4:])
    assert ours == theirs
    assert ours[1] == (JobStatus.SUCCEEDED, {"text": "it's «1» 日本", "n": [1, None, 0.5]},
                       10, first, at, at, None)

    with pytest.raises(ValueError, match="expanding"):
        ManyStatement(update(TABLE).where(TABLE.c.id.in_(["a", "b"]))
                      .values(error=None)).run(sessions(), [{}])


def test_many_statement_stores_what_sqlalchemy_stores(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    """See check_many_statement_stores_what_sqlalchemy_stores."""
    check_many_statement_stores_what_sqlalchemy_stores(sessions, tenant)
