"""Batches (OpenAI's Batch API): the `batches` table, its status lifecycle and queries.

Responsible for: the Batch row (every field OpenAI's batch object carries, plus the
fan-out cursor `num_enqueued`), the status machine

    validating ──► in_progress ──► finalizing ──► completed
        │  │            │  │
        │  └──► failed   │  └──► expired
        └──► cancelling ◄┘ ──► cancelled

with one `<status>_at` stamp per status, and the queries the API and the batch loop run.
The caller commits.
"""

from __future__ import annotations

import enum
import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Enum,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    literal,
    select,
    tuple_,
)
from sqlalchemy.orm import Mapped, Session, mapped_column

from core.deadlines import duration_seconds
from storage.models import Base, UTCDateTime, utcnow


class BatchStatus(enum.StrEnum):
    """Lifecycle of a batch, as OpenAI names it."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """True once the batch can no longer change."""
        return self in _TERMINAL


_TERMINAL = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)
ACTIVE_STATUSES: tuple[BatchStatus, ...] = tuple(s for s in BatchStatus if s not in _TERMINAL)

# old status → the statuses it may move to. Any active batch may fail: validation fails
# it, and so does the batch loop when the same unexpected error stops it pass after pass.
BATCH_TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.VALIDATING: frozenset(
        {BatchStatus.IN_PROGRESS, BatchStatus.FAILED, BatchStatus.CANCELLING,
         BatchStatus.EXPIRED}
    ),
    BatchStatus.IN_PROGRESS: frozenset(
        {BatchStatus.FINALIZING, BatchStatus.CANCELLING, BatchStatus.EXPIRED,
         BatchStatus.FAILED}
    ),
    BatchStatus.FINALIZING: frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED}),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED, BatchStatus.FAILED}),
    BatchStatus.FAILED: frozenset(),
    BatchStatus.COMPLETED: frozenset(),
    BatchStatus.EXPIRED: frozenset(),
    BatchStatus.CANCELLED: frozenset(),
}


class IllegalBatchTransition(ValueError):
    """A status change the batch lifecycle does not allow."""

    def __init__(self, old: BatchStatus, new: BatchStatus) -> None:
        super().__init__(f"a {old.value} batch cannot become {new.value}")
        self.old = old
        self.new = new


class Batch(Base):
    """One batch: an input file fanned out into jobs, and its output and error files."""

    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_batches_status", "status"),
        Index("ix_batches_input_file", "input_file_id"),
        UniqueConstraint("tenant_id", "idempotency_key",
                         name="uq_batches_tenant_idempotency_key"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[BatchStatus] = mapped_column(
        Enum(BatchStatus, name="batch_status", values_callable=lambda e: [m.value for m in e]),
        default=BatchStatus.VALIDATING,
    )
    endpoint: Mapped[str] = mapped_column(String(64))
    # No foreign key: a finished batch keeps naming its input after the file is deleted.
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    priority: Mapped[str] = mapped_column(String(8))
    # The one model every request uses; known after validation (or given up front).
    model: Mapped[str | None] = mapped_column(String(200), default=None)
    # Given at creation: replaces each line's `body.model` (run OpenAI files unchanged).
    model_override: Mapped[str | None] = mapped_column(String(200), default=None)
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON, default=None)
    # Where batch.* webhook events go (the `callback_url` field, or that metadata key).
    callback_url: Mapped[str | None] = mapped_column(Text, default=None)
    # OpenAI's `errors.data`: [{code, line, message, param}], set when validation fails.
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    output_file_id: Mapped[str | None] = mapped_column(String(40), default=None)
    error_file_id: Mapped[str | None] = mapped_column(String(40), default=None)
    # OpenAI's `output_expires_after.seconds`: each result file expires this long after
    # its own creation; None keeps them until deleted.
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer, default=None)
    # The creating request's Idempotency-Key and body hash: a retry with the same key
    # gets this batch back (the same key with another body is a 409).
    idempotency_key: Mapped[str | None] = mapped_column(String(200), default=None)
    request_hash: Mapped[str | None] = mapped_column(String(64), default=None)

    num_requests: Mapped[int] = mapped_column(Integer, default=0)
    # Fan-out cursor: the first this-many requests of the input file are jobs already.
    num_enqueued: Mapped[int] = mapped_column(Integer, default=0)
    num_completed: Mapped[int] = mapped_column(Integer, default=0)
    num_failed: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)

    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)

    def can_move_to(self, new: BatchStatus) -> bool:
        """Whether the lifecycle allows this batch to become `new` now."""
        return new in BATCH_TRANSITIONS[self.status]

    def move_to(self, new: BatchStatus, *, at: datetime | None = None) -> None:
        """Change status and stamp `<new>_at`; IllegalBatchTransition if not allowed."""
        if not self.can_move_to(new):
            raise IllegalBatchTransition(self.status, new)
        self.status = new
        setattr(self, f"{new.value}_at", at or utcnow())


def completion_window_seconds(completion_window: str) -> int:
    """Seconds in a completion window such as `24h`, `30m`, `90s` or `7d`; ValueError else."""
    try:
        return duration_seconds(completion_window)
    except ValueError as e:
        raise ValueError(f"completion_window {e}") from e


def _unix(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


def batch_object(batch: Batch) -> dict[str, Any]:
    """The batch as OpenAI's API shows it (`openai.types.Batch`), plus its `priority` and
    `estimated_completion_at`: the same object in every read, list and webhook."""
    total_tokens = batch.input_tokens + batch.output_tokens
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": None if batch.errors is None else {"object": "list", "data": batch.errors},
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status.value,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": _unix(batch.created_at),
        "in_progress_at": _unix(batch.in_progress_at),
        "expires_at": _unix(batch.expires_at),
        "finalizing_at": _unix(batch.finalizing_at),
        "completed_at": _unix(batch.completed_at),
        "failed_at": _unix(batch.failed_at),
        "expired_at": _unix(batch.expired_at),
        "cancelling_at": _unix(batch.cancelling_at),
        "cancelled_at": _unix(batch.cancelled_at),
        "request_counts": {"total": batch.num_requests, "completed": batch.num_completed,
                           "failed": batch.num_failed},
        "metadata": batch.metadata_,
        "model": batch.model,
        "usage": {
            "input_tokens": batch.input_tokens,
            "input_tokens_details": {"cached_tokens": batch.cached_tokens},
            "output_tokens": batch.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": total_tokens,
        },
        "priority": batch.priority,
        # Only a running batch has one; the API's read fills it in (api.batch_state).
        "estimated_completion_at": None,
    }


def new_batch_id() -> str:
    """A fresh id in OpenAI's style (`batch_` + 24 hex digits)."""
    return f"batch_{secrets.token_hex(12)}"


def create_batch(
    session: Session, *, tenant_id: str, input_file_id: str, endpoint: str,
    completion_window: str, expires_at: datetime, priority: str,
    metadata: dict[str, str] | None = None, model_override: str | None = None,
    callback_url: str | None = None, output_expires_after_s: int | None = None,
    idempotency_key: str | None = None, request_hash: str | None = None,
) -> Batch:
    """Add a batch in `validating`; the batch loop validates and fans it out.
    IntegrityError (at the flush) when the tenant already has a batch of `idempotency_key`."""
    now = utcnow()
    batch = Batch(
        id=new_batch_id(), tenant_id=tenant_id, status=BatchStatus.VALIDATING,
        endpoint=endpoint, input_file_id=input_file_id, completion_window=completion_window,
        priority=priority, metadata_=metadata, model=model_override,
        model_override=model_override, callback_url=callback_url, created_at=now,
        expires_at=expires_at, output_expires_after_s=output_expires_after_s,
        idempotency_key=idempotency_key, request_hash=request_hash,
    )
    session.add(batch)
    session.flush()
    return batch


def find_batch_by_idempotency_key(session: Session, *, tenant_id: str, key: str
                                  ) -> Batch | None:
    """The tenant's batch created with this Idempotency-Key, if any."""
    return session.scalars(select(Batch).where(Batch.tenant_id == tenant_id,
                                               Batch.idempotency_key == key)).first()


def get_batch(session: Session, *, batch_id: str, tenant_id: str | None = None) -> Batch | None:
    """The batch, or None if unknown (or another tenant's when `tenant_id` is given)."""
    batch = session.get(Batch, batch_id)
    if batch is None or (tenant_id is not None and batch.tenant_id != tenant_id):
        return None
    return batch


def list_batches(
    session: Session, *, tenant_id: str, limit: int = 20, after: str | None = None
) -> tuple[list[Batch], bool]:
    """One page of the tenant's batches, newest first; the bool says whether more follow."""
    query = select(Batch).where(Batch.tenant_id == tenant_id)
    if after is not None:
        cursor = get_batch(session, batch_id=after, tenant_id=tenant_id)
        if cursor is None:
            raise ValueError(f"after: no batch {after!r}")
        at = tuple_(literal(cursor.created_at, UTCDateTime), literal(cursor.id))
        query = query.where(tuple_(Batch.created_at, Batch.id) < at)
    query = query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
    rows = list(session.scalars(query))
    return rows[:limit], len(rows) > limit


def is_file_in_use(session: Session, *, file_id: str) -> bool:
    """Whether a batch that has not finished reads `file_id` as its input."""
    query = select(Batch.id).where(
        Batch.input_file_id == file_id, Batch.status.in_(ACTIVE_STATUSES)
    ).limit(1)
    return session.scalar(query) is not None


def active_batch_ids(session: Session, *, limit: int = 100) -> list[str]:
    """Ids of batches the batch loop still has work on, oldest first."""
    query = (
        select(Batch.id).where(Batch.status.in_(ACTIVE_STATUSES))
        .order_by(Batch.created_at, Batch.id).limit(limit)
    )
    return list(session.scalars(query))


def lock_batch(session: Session, *, batch_id: str) -> Batch | None:
    """The batch row locked for this transaction; None if another process holds it.

    PostgreSQL: `FOR UPDATE SKIP LOCKED`, so two batch loops never work the same batch at
    once. SQLite ignores the clause; its single writer serialises the loops instead.
    """
    query = (
        select(Batch).where(Batch.id == batch_id)
        .with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)
    )
    return session.scalar(query)


def request_cancel(session: Session, *, batch_id: str, tenant_id: str) -> Batch | None:
    """Move a batch to `cancelling` (the batch loop stops its jobs); None if unknown.

    Cancelling twice is harmless; IllegalBatchTransition for a batch past the point of
    cancelling (finalizing or finished).
    """
    batch = session.scalar(
        select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id)
        .with_for_update().execution_options(populate_existing=True)
    )
    if batch is None:
        return None
    if batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        return batch
    batch.move_to(BatchStatus.CANCELLING)
    session.flush()
    return batch
