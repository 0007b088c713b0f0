"""The runner without Celery: dispatch claims once, deliver signs, records and counts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy
from prometheus_client import REGISTRY
from sqlalchemy.orm import Session
from standardwebhooks import Webhook

from core.settings import Settings
from storage.deliveries import get_delivery
from storage.models import Tenant
from storage.webhook_events import EventType, enqueue_event
from storage.webhook_secrets import ensure_webhook_secret
from storage.webhooks import DeliveryStatus
from tests.utils.webhook_receiver import Reply, WebhookReceiver, run_receiver
from workers.callbacks.app import DELIVER_TASK, DISPATCH_TASK, create_celery_app
from workers.callbacks.runner import DeliveryRunner


@pytest.fixture
def runner(tmp_path: Path, engine: sqlalchemy.Engine) -> Iterator[DeliveryRunner]:
    settings = Settings(data_dir=tmp_path, database_url=str(engine.url),
                        webhook_allowlist=["127.0.0.1"], webhook_retry_schedule=[60.0],
                        webhook_timeout_s=2.0, webhook_claim_s=5.0)
    runner = DeliveryRunner(settings)
    yield runner
    runner.close()


def sample(name: str, event_type: str = "job.failed") -> float:
    return REGISTRY.get_sample_value(name, {"event_type": event_type}) or 0.0


def test_dispatch_then_deliver_retry_then_fail(
    runner: DeliveryRunner, session: Session, tenant: Tenant
) -> None:
    with run_receiver(WebhookReceiver([Reply(status=503), Reply(status=500)])) as receiver:
        delivery = enqueue_event(session, tenant_id=tenant.id, event_type=EventType.JOB_FAILED,
                                 url=receiver.url, payload={"id": "job_9"})
        secret = ensure_webhook_secret(session, tenant_id=tenant.id).secret
        session.commit()
        attempts_before = sample("batchinfer_webhook_attempts_total")
        failed_before = sample("batchinfer_webhook_deliveries_failed_total")

        enqueued: list[tuple[str, str]] = []
        assert runner.dispatch_due(lambda *args: enqueued.append(args)) == 1
        assert runner.dispatch_due(lambda *args: enqueued.append(args)) == 0  # claimed
        [(delivery_id, token)] = enqueued
        assert runner.deliver(delivery_id, token) is DeliveryStatus.PENDING
        assert runner.deliver(delivery_id, token) is None  # the same message again: no-op
        [request] = receiver.requests
        Webhook(secret).verify(request.body, request.headers)

        # The schedule has one retry, 60 s away: bring it forward by hand.
        session.execute(sqlalchemy.text(
            "UPDATE webhook_deliveries SET next_attempt_at = created_at"))
        session.commit()
        enqueued.clear()
        assert runner.dispatch_due(lambda *args: enqueued.append(args)) == 1
        assert runner.deliver(*enqueued[0]) is DeliveryStatus.FAILED  # schedule exhausted
        assert receiver.requests[1].headers["webhook-id"] == delivery.webhook_id

    loaded = get_delivery(session, delivery_id=delivery.id)
    assert loaded is not None and loaded.status is DeliveryStatus.FAILED
    assert [a.status_code for a in loaded.attempts] == [503, 500]
    assert sample("batchinfer_webhook_attempts_total") == attempts_before + 2
    assert sample("batchinfer_webhook_deliveries_failed_total") == failed_before + 1


def test_celery_app_settings(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, redis_url="redis://127.0.0.1:6399/3",
                        topic_prefix="bx", webhook_dispatch_interval_s=0.5)
    app = create_celery_app(settings)
    conf = app.conf
    assert conf.broker_url == "redis://127.0.0.1:6399/3"
    assert conf.task_acks_late is True and conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.task_default_queue == "bx.webhooks"
    [entry] = conf.beat_schedule.values()
    assert entry["task"] == DISPATCH_TASK and entry["schedule"] == 0.5
    assert {DISPATCH_TASK, DELIVER_TASK} <= set(app.tasks)
