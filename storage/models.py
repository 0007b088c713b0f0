"""SQLAlchemy 2 table models: tenants, API keys, jobs and worker heartbeats.

The job row is the source of truth for a job's state; its status follows
`queued → running → succeeded | failed | cancelled` (see `storage.states`). A running
job names its worker, whose heartbeat row says whether anyone still owns it.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Dialect,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    """Timezone-aware now, the only clock the database sees."""
    return datetime.now(UTC)


def unix_seconds(moment: datetime | None) -> int | None:
    """`moment` as whole Unix seconds, the way OpenAI's objects carry times; None stays None."""
    return int(moment.timestamp()) if moment is not None else None


class UTCDateTime(TypeDecorator[datetime]):
    """`DateTime(timezone=True)` that always hands back aware UTC datetimes.

    SQLite keeps no zone and returns naive values; without this, `now - job.created_at`
    would work on PostgreSQL and raise on SQLite.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Refuse naive datetimes; store UTC (SQLite stores the naive UTC wall time)."""
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware one, e.g. datetime.now(UTC)")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Aware UTC whatever the backend returned."""
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    """Declarative base for every table."""


class JobStatus(enum.StrEnum):
    """Lifecycle of a job, in order."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # Still unfinished at its deadline (a job's own `deadline`; a batch's jobs end with
    # their batch's window instead).
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        """True once the job can no longer change."""
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED,
                        JobStatus.EXPIRED)


class Tenant(Base):
    """A customer; every job and key belongs to one."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiKey(Base):
    """A bearer key; only its SHA-256 is stored, plus a short prefix to recognise it."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)


# Queued batch jobs: the rows ix_jobs_queued_batch_lines holds. Written out as SQL, in the
# index and in the query it serves, so that the planner matches the two (a bound
# parameter would hide the status from a cached generic plan).
QUEUED_BATCH_JOB = "status = 'queued' AND batch_id IS NOT NULL"


class Job(Base):
    """One inference request and, once done, its result."""

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
        Index("ix_jobs_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_jobs_status_queued_at", "status", "queued_at"),
        Index("ix_jobs_batch", "batch_id", "status"),
        # count_active_jobs runs on every submission.
        Index("ix_jobs_tenant_status", "tenant_id", "status"),
        # The reconciler expires queued and running jobs past their deadline.
        Index("ix_jobs_status_deadline", "status", "deadline"),
        # The batch fan-out's window: queued batch jobs per model, priority and tenant.
        Index("ix_jobs_queued_batch_lines", "model", "priority", "tenant_id",
              postgresql_where=text(QUEUED_BATCH_JOB), sqlite_where=text(QUEUED_BATCH_JOB)),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[JobStatus] = mapped_column(
        Enum(JobStatus, name="job_status", values_callable=lambda e: [m.value for m in e]),
        default=JobStatus.QUEUED,
    )
    priority: Mapped[str] = mapped_column(String(8))
    model: Mapped[str] = mapped_column(String(200))
    # "chat.completion" or "text_completion": the shape of `result`.
    kind: Mapped[str] = mapped_column(String(20))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    cached_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # When the job was last produced to Kafka; the reconciler re-publishes stale ones.
    queued_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    first_token_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[str | None] = mapped_column(String(100), default=None)
    batch_id: Mapped[str | None] = mapped_column(String(40), default=None)
    custom_id: Mapped[str | None] = mapped_column(String(512), default=None)
    callback_url: Mapped[str | None] = mapped_column(Text, default=None)
    # `metadata` is reserved on declarative classes; the column keeps the public name.
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, default=None)
    cache_key: Mapped[str | None] = mapped_column(String(200), default=None)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), default=None)
    # SHA-256 of the canonical request body: a replayed key with another body is a 409.
    request_hash: Mapped[str | None] = mapped_column(String(64), default=None)
    # When the job must be done by (from `deadline` or a batch's completion window): within
    # a priority the earliest runs first; past it the job is expired.
    deadline: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)


class WorkerHeartbeat(Base):
    """A live inference worker: the id its claimed jobs carry and when it last beat.

    A running job whose worker has no row here, or a row older than the heartbeat
    timeout, has no live owner; the reconciler hands it back to the queue.
    """

    __tablename__ = "workers"

    # Same width as jobs.worker_id, the value it is matched against.
    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # The served model it runs and its measured pace (for estimates): tokens computed per
    # busy second, and seconds per engine step (what one sequence waits per token).
    model: Mapped[str | None] = mapped_column(String(200), default=None)
    tokens_per_s: Mapped[float | None] = mapped_column(Float, default=None)
    step_s: Mapped[float | None] = mapped_column(Float, default=None)
    # The work its engine's live requests have left (None: not reported; see
    # workers.engine.outputs.EngineStats): how many, the tokens the model computes for
    # them if each runs to its max_tokens, and of those the tokens still to be generated.
    num_requests_left: Mapped[int | None] = mapped_column(Integer, default=None)
    num_tokens_to_compute: Mapped[int | None] = mapped_column(Integer, default=None)
    num_output_tokens_left: Mapped[int | None] = mapped_column(Integer, default=None)
    # Seconds of a decode step of one sequence alone, by its engine's fitted step cost:
    # what a job that outlasts the others waits per token.
    solo_step_s: Mapped[float | None] = mapped_column(Float, default=None)


class TenantLimit(Base):
    """A tenant's token budgets and fair-share weight, for all its models (`model` "*")
    or for one model. A missing budget (None) means no limit of that kind."""

    __tablename__ = "tenant_limits"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, default=None)
    tokens_per_day: Mapped[int | None] = mapped_column(Integer, default=None)
    # Share of a priority's capacity against other tenants with queued work (only the
    # "*" row's weight is used).
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
