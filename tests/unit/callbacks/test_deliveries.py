"""Delivery rows: events, atomic claims, stale task messages, attempts, retries, secrets."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from storage.deliveries import (
    claim_delivery,
    due_delivery_ids,
    get_delivery,
    list_deliveries,
    record_attempt,
    request_retry,
    start_attempt,
)
from storage.models import Tenant, utcnow
from storage.tenants import create_tenant
from storage.webhook_events import EventType, enqueue_event
from storage.webhook_secrets import (
    ROTATION_OVERLAP,
    ensure_webhook_secret,
    rotate_webhook_secret,
    signing_secrets,
)
from storage.webhooks import Delivery, DeliveryStatus

LEASE = timedelta(seconds=30)
JOB = {"id": "job_123", "object": "job", "status": "succeeded"}


def enqueue(session: Session, tenant: Tenant, data: dict | None = None) -> Delivery:
    delivery = enqueue_event(session, tenant_id=tenant.id, event_type=EventType.JOB_SUCCEEDED,
                             url="https://example.com/hook", payload=data or JOB)
    session.commit()
    return delivery


def test_enqueue_event_wraps_the_object(session: Session, tenant: Tenant) -> None:
    delivery = enqueue(session, tenant)
    assert delivery.job_id == "job_123" and delivery.batch_id is None
    assert delivery.webhook_id.startswith("msg_") and delivery.status is DeliveryStatus.PENDING
    assert delivery.payload["type"] == "job.succeeded"
    assert delivery.payload["data"] == JOB
    assert delivery.payload["timestamp"].endswith("Z")
    batch = enqueue_event(session, tenant_id=tenant.id, event_type="batch.expired",
                          url="https://example.com/hook", payload={"id": "batch_1"})
    assert batch.batch_id == "batch_1" and batch.job_id is None
    with pytest.raises(ValueError):
        enqueue_event(session, tenant_id=tenant.id, event_type="job.exploded",
                      url="https://example.com/hook", payload=JOB)
    with pytest.raises(ValueError, match="id"):
        enqueue_event(session, tenant_id=tenant.id, event_type="job.failed",
                      url="https://example.com/hook", payload={"status": "failed"})


def test_only_one_of_two_dispatchers_claims(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant
) -> None:
    delivery = enqueue(session, tenant)
    now = utcnow()
    with sessions() as first, sessions() as second:
        assert due_delivery_ids(first, now=now, limit=10) == [delivery.id]
        token = claim_delivery(first, delivery_id=delivery.id, now=now, lease=LEASE)
        first.commit()
        assert claim_delivery(second, delivery_id=delivery.id, now=now, lease=LEASE) is None
        second.commit()
    assert token is not None
    assert due_delivery_ids(session, now=now, limit=10) == []
    # Once the lease has passed (the worker died), the delivery is due again.
    later = now + LEASE + timedelta(seconds=1)
    assert due_delivery_ids(session, now=later, limit=10) == [delivery.id]


def test_stale_or_duplicate_task_message_does_nothing(session: Session, tenant: Tenant) -> None:
    delivery = enqueue(session, tenant)
    now = utcnow()
    token = claim_delivery(session, delivery_id=delivery.id, now=now, lease=LEASE)
    session.commit()
    assert token is not None
    assert start_attempt(session, delivery_id=delivery.id, claim_token="other", lease=LEASE) is None
    started = start_attempt(session, delivery_id=delivery.id, claim_token=token, lease=LEASE)
    session.commit()
    assert started is not None and started.claim_token is None
    # The broker redelivering the same message: the token is spent.
    assert start_attempt(session, delivery_id=delivery.id, claim_token=token, lease=LEASE) is None


def begin(session: Session, delivery_id: str, *, at: datetime | None = None) -> None:
    """Claim and start an attempt, as the dispatcher and a worker do."""
    token = claim_delivery(session, delivery_id=delivery_id, now=at or utcnow(), lease=LEASE)
    assert token is not None
    assert start_attempt(session, delivery_id=delivery_id, claim_token=token, lease=LEASE)
    session.commit()


def test_attempts_are_recorded_and_release_the_claim(session: Session, tenant: Tenant) -> None:
    delivery = enqueue(session, tenant)
    due = utcnow() + timedelta(seconds=5)
    begin(session, delivery.id)
    record_attempt(session, delivery_id=delivery.id, attempted_at=utcnow(), webhook_timestamp=1,
                   status_code=503, latency_ms=12.5, error="HTTP 503", response_body="busy",
                   status=DeliveryStatus.PENDING, next_attempt_at=due)
    session.commit()
    assert due_delivery_ids(session, now=utcnow(), limit=10) == []
    begin(session, delivery.id, at=due + timedelta(seconds=1))
    done = record_attempt(session, delivery_id=delivery.id, attempted_at=utcnow(),
                          webhook_timestamp=2, status_code=200, latency_ms=3.0, error=None,
                          response_body=None, status=DeliveryStatus.SUCCEEDED,
                          next_attempt_at=None)
    session.commit()
    assert done.num_attempts == 2 and done.status is DeliveryStatus.SUCCEEDED
    assert done.finished_at is not None and done.next_attempt_at is None
    loaded = get_delivery(session, delivery_id=delivery.id, tenant_id=tenant.id)
    assert loaded is not None
    assert [a.status_code for a in loaded.attempts] == [503, 200]
    assert [a.webhook_timestamp for a in loaded.attempts] == [1, 2]
    with pytest.raises(ValueError):
        record_attempt(session, delivery_id=delivery.id, attempted_at=utcnow(),
                       webhook_timestamp=3, status_code=200, latency_ms=1.0, error=None,
                       response_body=None, status=DeliveryStatus.PENDING, next_attempt_at=None)


def test_list_and_retry_stay_within_the_tenant(session: Session, tenant: Tenant) -> None:
    other = create_tenant(session, name="globex")
    delivery = enqueue(session, tenant)
    begin(session, delivery.id)
    record_attempt(session, delivery_id=delivery.id, attempted_at=utcnow(), webhook_timestamp=1,
                   status_code=410, latency_ms=1.0, error="gone", response_body=None,
                   status=DeliveryStatus.FAILED, next_attempt_at=None)
    session.commit()
    assert [d.id for d in list_deliveries(session, tenant_id=tenant.id, job_id="job_123")] == [
        delivery.id
    ]
    assert list_deliveries(session, tenant_id=other.id, job_id="job_123") == []
    assert request_retry(session, delivery_id=delivery.id, tenant_id=other.id) is None
    retried = request_retry(session, delivery_id=delivery.id, tenant_id=tenant.id)
    session.commit()
    assert retried is not None and retried.status is DeliveryStatus.PENDING
    assert retried.webhook_id == delivery.webhook_id and retried.finished_at is None
    assert due_delivery_ids(session, now=utcnow(), limit=10) == [delivery.id]


def test_secret_rotation_signs_with_both_during_the_overlap(
    session: Session, tenant: Tenant
) -> None:
    first = ensure_webhook_secret(session, tenant_id=tenant.id).secret
    assert first.startswith("whsec_")
    assert signing_secrets(session, tenant_id=tenant.id) == [first]
    row = rotate_webhook_secret(session, tenant_id=tenant.id)
    session.commit()
    assert row.secret != first and row.previous_secret == first
    assert signing_secrets(session, tenant_id=tenant.id) == [row.secret, first]
    after = utcnow() + ROTATION_OVERLAP + timedelta(seconds=1)
    assert signing_secrets(session, tenant_id=tenant.id, now=after) == [row.secret]
    with pytest.raises(ValueError, match="unknown tenant"):
        ensure_webhook_secret(session, tenant_id="ten_missing")


def test_retry_requested_during_an_attempt_is_kept(session: Session, tenant: Tenant) -> None:
    delivery = enqueue(session, tenant)
    begin(session, delivery.id)
    assert request_retry(session, delivery_id=delivery.id, tenant_id=tenant.id) is not None
    session.commit()
    done = record_attempt(session, delivery_id=delivery.id, attempted_at=utcnow(),
                          webhook_timestamp=1, status_code=200, latency_ms=1.0, error=None,
                          response_body=None, status=DeliveryStatus.SUCCEEDED,
                          next_attempt_at=None)
    session.commit()
    assert done.status is DeliveryStatus.PENDING and done.finished_at is None
    assert done.num_attempts == 1 and done.claimed_until is None
    assert due_delivery_ids(session, now=utcnow(), limit=10) == [delivery.id]


def test_an_attempt_that_never_reported_back_is_due_after_the_lease(
    session: Session, tenant: Tenant
) -> None:
    delivery = enqueue(session, tenant)
    begin(session, delivery.id)  # ... and the worker dies here
    now = utcnow()
    assert due_delivery_ids(session, now=now, limit=10) == []
    later = now + LEASE + timedelta(seconds=1)
    assert due_delivery_ids(session, now=later, limit=10) == [delivery.id]
    assert claim_delivery(session, delivery_id=delivery.id, now=later, lease=LEASE) is not None
