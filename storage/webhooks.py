"""Webhook tables: per-tenant signing secrets, deliveries and their attempts.

A delivery is one event for one URL; its row carries the retry schedule's state
(`next_attempt_at`) and a short claim (`claimed_until`, `claim_token`) that makes sure
only one dispatcher hands it to one worker at a time. Every HTTP attempt adds a
DeliveryAttempt row. Queries live in `storage.deliveries` and `storage.webhook_secrets`.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Enum, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from storage.models import Base, UTCDateTime, utcnow


class DeliveryStatus(enum.StrEnum):
    """Where a delivery stands: still trying, delivered, or given up."""

    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class WebhookSecret(Base):
    """A tenant's signing secret, and the one it replaced while receivers catch up."""

    __tablename__ = "webhook_secrets"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    # `whsec_` + base64 key; kept in clear because signing needs the key itself.
    secret: Mapped[str] = mapped_column(String(100))
    previous_secret: Mapped[str | None] = mapped_column(String(100), default=None)
    # When `secret` replaced `previous_secret`; both sign until the overlap has passed.
    rotated_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Delivery(Base):
    """One event to POST to one callback URL, with its retry state."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        # The dispatcher's scan: pending rows whose next attempt is due.
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_job", "job_id", "created_at"),
        Index("ix_webhook_deliveries_batch", "batch_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    job_id: Mapped[str | None] = mapped_column(String(40), default=None)
    batch_id: Mapped[str | None] = mapped_column(String(40), default=None)
    event_type: Mapped[str] = mapped_column(String(40))
    # The `webhook-id` header: the same on every attempt, the receiver's idempotency key.
    webhook_id: Mapped[str] = mapped_column(String(40), unique=True)
    url: Mapped[str] = mapped_column(Text)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[DeliveryStatus] = mapped_column(
        Enum(DeliveryStatus, name="webhook_delivery_status",
             values_callable=lambda e: [m.value for m in e]),
        default=DeliveryStatus.PENDING,
    )
    num_attempts: Mapped[int] = mapped_column("attempts", Integer, default=0)
    # None while an attempt runs and once finished; a retry request sets it again.
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    # A dispatcher's claim: nobody else dispatches the row before this instant.
    claimed_until: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    # Names the one task message allowed to act on the current claim.
    claim_token: Mapped[str | None] = mapped_column(String(40), default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)

    attempts: Mapped[list[DeliveryAttempt]] = relationship(
        back_populates="delivery", order_by="DeliveryAttempt.id", cascade="all, delete-orphan"
    )


class DeliveryAttempt(Base):
    """One HTTP attempt of a delivery: when, what came back, how long it took."""

    __tablename__ = "webhook_delivery_attempts"
    __table_args__ = (Index("ix_webhook_delivery_attempts_delivery", "delivery_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE")
    )
    attempted_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # The `webhook-timestamp` sent: a fresh one per attempt.
    webhook_timestamp: Mapped[int] = mapped_column(Integer)
    # None when no HTTP answer came (timeout, connection error, refused address).
    status_code: Mapped[int | None] = mapped_column(Integer, default=None)
    latency_ms: Mapped[float] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    # The first bytes of the receiver's answer (at most webhook_max_response_bytes).
    response_body: Mapped[str | None] = mapped_column(Text, default=None)
    # When this attempt scheduled the next one; None when it was the last.
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)

    delivery: Mapped[Delivery] = relationship(back_populates="attempts")
