"""What the batch fan-out's shared window is planned from: batches with lines still in
their input files, and the batch jobs queued per model, priority and tenant.

The window (`batch_max_queued_lines`) is counted per (model, priority), the pair whose
topic order the batches' lines share, so each scheduler pass reads every pair at once in
two grouped queries: one over in-progress batches (few rows), one over queued batch
jobs, which ix_jobs_queued_batch_lines answers from the index alone (it holds queued
batch jobs only, at most about a window per pair). Functions never write.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from storage.batches import Batch, BatchStatus
from storage.models import QUEUED_BATCH_JOB, Job

# The pair a window is counted for.
Pair = tuple[str, str]  # (model, priority)


@dataclass(frozen=True, slots=True)
class WaitingBatch:
    """An in-progress batch with lines not yet enqueued."""

    batch_id: str
    tenant_id: str
    model: str
    priority: str
    num_left: int  # lines of its input file not yet jobs
    expires_at: datetime
    created_at: datetime


def waiting_batches(session: Session, *, now: datetime, limit: int = 1000
                    ) -> list[WaitingBatch]:
    """In-progress batches inside their window with lines left to enqueue, earliest
    deadline first (then creation, then id)."""
    query = (
        select(Batch.id, Batch.tenant_id, Batch.model, Batch.priority,
               Batch.num_requests - Batch.num_enqueued, Batch.expires_at, Batch.created_at)
        .where(Batch.status == BatchStatus.IN_PROGRESS, Batch.model.is_not(None),
               Batch.num_enqueued < Batch.num_requests, Batch.expires_at > now)
        .order_by(Batch.expires_at, Batch.created_at, Batch.id)
        .limit(limit)
    )  # fmt: skip
    return [WaitingBatch(batch_id, tenant_id, model or "", priority, int(num_left),
                         expires_at, created_at)
            for batch_id, tenant_id, model, priority, num_left, expires_at, created_at
            in session.execute(query)]  # model: never None (filtered above)


def queued_batch_lines(session: Session) -> dict[Pair, dict[str, int]]:
    """(model, priority) -> tenant id -> that tenant's batch jobs queued (not claimed)."""
    query = (
        select(Job.model, Job.priority, Job.tenant_id, func.count())
        .where(text(QUEUED_BATCH_JOB))  # the index's own predicate
        .group_by(Job.model, Job.priority, Job.tenant_id)
    )  # fmt: skip
    counts: dict[Pair, dict[str, int]] = {}
    for model, priority, tenant_id, num in session.execute(query):
        counts.setdefault((model, priority), {})[tenant_id] = int(num)
    return counts


def unqueued_lines_ahead(session: Session, batch: Batch, *, now: datetime) -> int:
    """Lines not yet enqueued of the batches of `batch`'s model and priority that the
    fan-out serves before it (an earlier deadline still ahead, or the same one and
    created first)."""
    query = (
        select(func.coalesce(func.sum(Batch.num_requests - Batch.num_enqueued), 0))
        .where(Batch.status == BatchStatus.IN_PROGRESS, Batch.model == batch.model,
               Batch.priority == batch.priority, Batch.num_enqueued < Batch.num_requests,
               Batch.expires_at > now,
               (Batch.expires_at < batch.expires_at)
               | ((Batch.expires_at == batch.expires_at)
                  & (Batch.created_at < batch.created_at)))
    )  # fmt: skip
    return int(session.scalar(query) or 0)
