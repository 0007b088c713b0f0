"""Delivery queries: enqueue, claim for dispatch, start and record attempts, list, retry.

A delivery changes hands in two atomic steps, so no two dispatchers or workers ever send
it at once:

1. `claim_delivery` (dispatcher): `UPDATE ... SET claimed_until = now + lease,
   claim_token = T WHERE id = :id AND status = 'pending' AND next_attempt_at <= now AND
   (claimed_until IS NULL OR claimed_until < now)`; only the dispatcher whose statement
   changed the row enqueues a task, carrying T.
2. `start_attempt` (worker): `UPDATE ... SET claim_token = NULL, claimed_until = now +
   lease, next_attempt_at = NULL WHERE id = :id AND claim_token = T`; a duplicate or
   stale task message (the broker redelivering, a claim that expired and was taken again)
   finds no row and stops.

A worker that dies mid-attempt leaves `claimed_until` in the future; once it passes, the
dispatcher claims the row again (a pending row without `next_attempt_at` is one whose
attempt never reported back). A retry requested while an attempt runs sets
`next_attempt_at`, which `record_attempt` then keeps. Functions flush but never commit.
"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    CursorResult,
    case,
    cast,
    func,
    literal,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session, selectinload

from storage.models import UTCDateTime, utcnow
from storage.webhooks import Delivery, DeliveryAttempt, DeliveryStatus

logger = logging.getLogger(__name__)

MAX_LIST_LIMIT = 100


def new_delivery_id() -> str:
    """`dlv_` + 24 random hex characters."""
    return f"dlv_{secrets.token_hex(12)}"


def new_webhook_id() -> str:
    """`msg_` + 24 random hex characters: the event's `webhook-id`."""
    return f"msg_{secrets.token_hex(12)}"


def create_delivery(
    session: Session,
    *,
    tenant_id: str,
    event_type: str,
    url: str,
    payload: dict[str, Any],
    job_id: str | None = None,
    batch_id: str | None = None,
) -> Delivery:
    """Add a pending delivery, due now."""
    now = utcnow()
    delivery = Delivery(
        id=new_delivery_id(),
        tenant_id=tenant_id,
        job_id=job_id,
        batch_id=batch_id,
        event_type=event_type,
        webhook_id=new_webhook_id(),
        url=url,
        payload=payload,
        status=DeliveryStatus.PENDING,
        num_attempts=0,
        next_attempt_at=now,
        created_at=now,
    )
    session.add(delivery)
    session.flush()
    return delivery


def due_delivery_ids(session: Session, *, now: datetime, limit: int) -> list[str]:
    """Pending deliveries whose next attempt is due and nobody holds; oldest due first."""
    query = (
        select(Delivery.id)
        .where(
            Delivery.status == DeliveryStatus.PENDING,
            _is_due(now),
            or_(Delivery.claimed_until.is_(None), Delivery.claimed_until < now),
        )
        .order_by(Delivery.next_attempt_at)
        .limit(limit)
    )
    return list(session.scalars(query))


def claim_delivery(
    session: Session, *, delivery_id: str, now: datetime, lease: timedelta
) -> str | None:
    """Claim a due delivery for one dispatch; its claim token, or None if someone has it."""
    token = secrets.token_hex(8)
    statement = (
        update(Delivery)
        .where(
            Delivery.id == delivery_id,
            Delivery.status == DeliveryStatus.PENDING,
            _is_due(now),
            or_(Delivery.claimed_until.is_(None), Delivery.claimed_until < now),
        )
        .values(claimed_until=now + lease, claim_token=token)
        .execution_options(synchronize_session=False)
    )
    return token if _rowcount(session.execute(statement)) == 1 else None


def start_attempt(
    session: Session, *, delivery_id: str, claim_token: str, lease: timedelta
) -> Delivery | None:
    """Turn a dispatch claim into a running attempt; None if the claim is no longer ours."""
    statement = (
        update(Delivery)
        .where(
            Delivery.id == delivery_id,
            Delivery.claim_token == claim_token,
            Delivery.status == DeliveryStatus.PENDING,
        )
        .values(claim_token=None, claimed_until=utcnow() + lease, next_attempt_at=None)
        .execution_options(synchronize_session=False)
    )
    if _rowcount(session.execute(statement)) != 1:
        return None
    return session.get(Delivery, delivery_id, populate_existing=True)


def record_attempt(
    session: Session,
    *,
    delivery_id: str,
    attempted_at: datetime,
    webhook_timestamp: int,
    status_code: int | None,
    latency_ms: float,
    error: str | None,
    response_body: str | None,
    status: DeliveryStatus,
    next_attempt_at: datetime | None,
) -> Delivery:
    """Store one attempt and the delivery's new state, releasing the claim."""
    if (status is DeliveryStatus.PENDING) != (next_attempt_at is not None):
        raise ValueError("a pending delivery needs next_attempt_at; a finished one none")
    session.add(
        DeliveryAttempt(
            delivery_id=delivery_id,
            attempted_at=attempted_at,
            webhook_timestamp=webhook_timestamp,
            status_code=status_code,
            latency_ms=latency_ms,
            error=error,
            response_body=response_body,
            next_attempt_at=next_attempt_at,
        )
    )
    finished_at = None if status is DeliveryStatus.PENDING else utcnow()
    # Set only by a retry requested during this attempt (start_attempt cleared it): then
    # the delivery stays pending, due when the retry asked, whatever this attempt did.
    retry_requested = Delivery.next_attempt_at.is_not(None)
    status_type = Delivery.__table__.c.status.type
    session.execute(
        update(Delivery)
        .where(Delivery.id == delivery_id)
        .values(
            num_attempts=Delivery.num_attempts + 1,
            # The CAST: PostgreSQL types a CASE of parameters as text, not as the enum.
            status=cast(case((retry_requested, DeliveryStatus.PENDING.value),
                             else_=status.value), status_type),
            next_attempt_at=func.coalesce(Delivery.next_attempt_at,
                                          literal(next_attempt_at, UTCDateTime)),
            finished_at=case((retry_requested, null()),
                             else_=literal(finished_at, UTCDateTime)),
            claimed_until=None,
            claim_token=None,
        )
        .execution_options(synchronize_session=False)
    )
    session.flush()
    delivery = session.get(Delivery, delivery_id, populate_existing=True)
    assert delivery is not None, "the delivery of a running attempt cannot vanish"
    return delivery


def get_delivery(
    session: Session, *, delivery_id: str, tenant_id: str | None = None
) -> Delivery | None:
    """A delivery with its attempts; with `tenant_id`, None unless that tenant owns it."""
    query = (
        select(Delivery)
        .where(Delivery.id == delivery_id)
        .options(selectinload(Delivery.attempts))
        .execution_options(populate_existing=True)
    )
    delivery = session.scalars(query).one_or_none()
    if delivery is None or (tenant_id is not None and delivery.tenant_id != tenant_id):
        return None
    return delivery


def list_deliveries(
    session: Session,
    *,
    tenant_id: str,
    job_id: str | None = None,
    batch_id: str | None = None,
    limit: int = MAX_LIST_LIMIT,
) -> list[Delivery]:
    """The tenant's deliveries for a job or a batch, oldest first, attempts loaded."""
    if (job_id is None) == (batch_id is None):
        raise ValueError("pass exactly one of job_id and batch_id")
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}")
    owner = Delivery.job_id == job_id if job_id is not None else Delivery.batch_id == batch_id
    query = (
        select(Delivery)
        .where(Delivery.tenant_id == tenant_id, owner)
        .options(selectinload(Delivery.attempts))
        .order_by(Delivery.created_at, Delivery.id)
        .limit(limit)
        .execution_options(populate_existing=True)
    )
    return list(session.scalars(query))


def request_retry(session: Session, *, delivery_id: str, tenant_id: str) -> Delivery | None:
    """Make the tenant's delivery due now (again), keeping its webhook-id; None if not theirs.

    A finished delivery goes back to pending and continues the retry schedule where it
    stopped; a pending one is simply brought forward.
    """
    if get_delivery(session, delivery_id=delivery_id, tenant_id=tenant_id) is None:
        return None
    session.execute(
        update(Delivery)
        .where(Delivery.id == delivery_id)
        .values(status=DeliveryStatus.PENDING, next_attempt_at=utcnow(), finished_at=None)
        .execution_options(synchronize_session=False)
    )
    logger.info("retry requested for delivery %s", delivery_id)
    return get_delivery(session, delivery_id=delivery_id, tenant_id=tenant_id)


def _is_due(now: datetime) -> ColumnElement[bool]:
    """Next attempt due, or an attempt that never reported back (its claim decides)."""
    return or_(Delivery.next_attempt_at.is_(None), Delivery.next_attempt_at <= now)


def _rowcount(result: object) -> int:
    """Rows an UPDATE changed."""
    assert isinstance(result, CursorResult)
    return result.rowcount
