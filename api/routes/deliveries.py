"""Webhook deliveries and the signing secret: list a job's deliveries, retry one, rotate.

`GET /v1/jobs/{id}/deliveries` and `GET /v1/batches/{id}/deliveries` list a job's or a
batch's deliveries with every attempt (a delivery's `id` is what a retry takes);
`POST /v1/deliveries/{id}/retry` makes one due again (a new attempt, the same
`webhook-id`); `GET /v1/webhook-secret` shows the tenant's signing secret and
`POST /v1/webhook-secret/rotate` replaces it (the old one signs too for a while).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel

from api.deps import SessionDep, TenantDep
from api.errors import NotFound
from storage.batches import get_batch
from storage.deliveries import get_delivery, list_deliveries, request_retry
from storage.jobs import get_job
from storage.models import unix_seconds
from storage.webhook_secrets import ROTATION_OVERLAP, ensure_webhook_secret, rotate_webhook_secret
from storage.webhooks import Delivery, DeliveryAttempt, DeliveryStatus, WebhookSecret

logger = logging.getLogger(__name__)

router = APIRouter(tags=["webhooks"])


class DeliveryAttemptPublic(BaseModel):
    """One HTTP attempt of a delivery."""

    attempted_at: int
    webhook_timestamp: int
    status_code: int | None
    latency_ms: float
    error: str | None
    response_body: str | None
    next_attempt_at: int | None

    @classmethod
    def from_attempt(cls, attempt: DeliveryAttempt) -> DeliveryAttemptPublic:
        """The public view of an attempt row."""
        return cls(
            attempted_at=int(attempt.attempted_at.timestamp()),
            webhook_timestamp=attempt.webhook_timestamp,
            status_code=attempt.status_code,
            latency_ms=round(attempt.latency_ms, 3),
            error=attempt.error,
            response_body=attempt.response_body,
            next_attempt_at=unix_seconds(attempt.next_attempt_at),
        )


class DeliveryPublic(BaseModel):
    """A webhook delivery: one event for one URL, and its attempts so far."""

    id: str
    object: Literal["webhook.delivery"] = "webhook.delivery"
    event_type: str
    webhook_id: str
    url: str
    status: DeliveryStatus
    job_id: str | None
    batch_id: str | None
    num_attempts: int
    next_attempt_at: int | None
    created_at: int
    finished_at: int | None
    payload: dict[str, Any]
    attempts: list[DeliveryAttemptPublic]

    @classmethod
    def from_delivery(cls, delivery: Delivery) -> DeliveryPublic:
        """The public view of a delivery row with its attempts."""
        return cls(
            id=delivery.id,
            event_type=delivery.event_type,
            webhook_id=delivery.webhook_id,
            url=delivery.url,
            status=delivery.status,
            job_id=delivery.job_id,
            batch_id=delivery.batch_id,
            num_attempts=delivery.num_attempts,
            next_attempt_at=unix_seconds(delivery.next_attempt_at),
            created_at=int(delivery.created_at.timestamp()),
            finished_at=unix_seconds(delivery.finished_at),
            payload=delivery.payload,
            attempts=[DeliveryAttemptPublic.from_attempt(a) for a in delivery.attempts],
        )


class DeliveryListPublic(BaseModel):
    """A job's or a batch's deliveries, oldest first."""

    object: Literal["list"] = "list"
    data: list[DeliveryPublic]


class WebhookSecretPublic(BaseModel):
    """The tenant's signing secret; while a rotation's overlap lasts, the old one too."""

    object: Literal["webhook.secret"] = "webhook.secret"
    secret: str
    previous_secret: str | None
    previous_secret_expires_at: int | None

    @classmethod
    def from_row(cls, row: WebhookSecret) -> WebhookSecretPublic:
        """The public view of a secret row; the old secret only while it still signs."""
        expires = None if row.rotated_at is None else row.rotated_at + ROTATION_OVERLAP
        still_signs = expires is not None and expires > datetime.now(expires.tzinfo)
        return cls(
            secret=row.secret,
            previous_secret=row.previous_secret if still_signs else None,
            previous_secret_expires_at=unix_seconds(expires) if still_signs else None,
        )


def delivery_not_found(delivery_id: str) -> NotFound:
    """The 404 for a delivery that does not exist or belongs to another tenant."""
    return NotFound(f"No delivery found with id '{delivery_id}'.", param="delivery_id",
                    code="delivery_not_found")


@router.get("/v1/jobs/{job_id}/deliveries", response_model=DeliveryListPublic)
def read_job_deliveries(job_id: str, tenant: TenantDep, session: SessionDep) -> DeliveryListPublic:
    """The webhook deliveries of a job, with every attempt."""
    if get_job(session, job_id=job_id, tenant_id=tenant.id) is None:
        raise NotFound(f"No job found with id '{job_id}'.", param="job_id",
                       code="job_not_found")
    deliveries = list_deliveries(session, tenant_id=tenant.id, job_id=job_id)
    return DeliveryListPublic(data=[DeliveryPublic.from_delivery(d) for d in deliveries])


@router.get("/v1/batches/{batch_id}/deliveries", response_model=DeliveryListPublic)
def read_batch_deliveries(batch_id: str, tenant: TenantDep, session: SessionDep
                          ) -> DeliveryListPublic:
    """The webhook deliveries of a batch (its own events, not its lines'), every attempt."""
    if get_batch(session, batch_id=batch_id, tenant_id=tenant.id) is None:
        raise NotFound(f"No such batch: '{batch_id}'.", param="batch_id")
    deliveries = list_deliveries(session, tenant_id=tenant.id, batch_id=batch_id)
    return DeliveryListPublic(data=[DeliveryPublic.from_delivery(d) for d in deliveries])


@router.get("/v1/deliveries/{delivery_id}", response_model=DeliveryPublic)
def read_delivery(delivery_id: str, tenant: TenantDep, session: SessionDep) -> DeliveryPublic:
    """One delivery with every attempt."""
    delivery = get_delivery(session, delivery_id=delivery_id, tenant_id=tenant.id)
    if delivery is None:
        raise delivery_not_found(delivery_id)
    return DeliveryPublic.from_delivery(delivery)


@router.post("/v1/deliveries/{delivery_id}/retry", status_code=202,
             response_model=DeliveryPublic)
def retry_delivery(delivery_id: str, tenant: TenantDep, session: SessionDep) -> DeliveryPublic:
    """Send a delivery again now (same webhook-id, so receivers can deduplicate)."""
    delivery = request_retry(session, delivery_id=delivery_id, tenant_id=tenant.id)
    if delivery is None:
        raise delivery_not_found(delivery_id)
    session.commit()
    return DeliveryPublic.from_delivery(delivery)


@router.get("/v1/webhook-secret", response_model=WebhookSecretPublic)
def read_webhook_secret(tenant: TenantDep, session: SessionDep) -> WebhookSecretPublic:
    """The secret that signs this tenant's webhooks (created on first use)."""
    row = ensure_webhook_secret(session, tenant_id=tenant.id)
    session.commit()
    return WebhookSecretPublic.from_row(row)


@router.post("/v1/webhook-secret/rotate", response_model=WebhookSecretPublic)
def rotate_secret(tenant: TenantDep, session: SessionDep) -> WebhookSecretPublic:
    """Replace the signing secret; the previous one keeps signing during the overlap."""
    row = rotate_webhook_secret(session, tenant_id=tenant.id)
    session.commit()
    logger.info("tenant %s rotated its webhook secret", tenant.id)
    return WebhookSecretPublic.from_row(row)
