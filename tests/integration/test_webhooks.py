"""Webhook callbacks end to end: real Redis, PostgreSQL, a Celery worker with beat
(subprocess) and a loopback receiver (127.0.0.1 allow-listed in these settings)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks import Webhook

from api.app import create_app
from core.kafka import ensure_topics
from core.settings import Settings
from scheduler.embedded_services import free_port
from storage.db import create_db_engine, session_factory
from storage.deliveries import get_delivery
from storage.jobs import complete_job, create_job, get_job
from storage.migrate import upgrade
from storage.models import Job, utcnow
from storage.tenants import create_api_key, create_tenant
from storage.webhook_events import enqueue_job_event, job_event_data
from storage.webhook_secrets import ensure_webhook_secret
from storage.webhooks import Delivery, DeliveryStatus
from tests.utils.callbacks_worker import CallbacksWorker
from tests.utils.service import WorkerProcess, running_api
from tests.utils.up_process import start_up
from tests.utils.webhook_receiver import ReceivedRequest, Reply, WebhookReceiver, run_receiver

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
RESULT = {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                                                    "message": {"role": "assistant",
                                                                "content": "hello"}}]}

MakeSettings = Callable[..., Settings]


@pytest.fixture
def hook_settings(tmp_path: Path, postgres_url: str, redis_url: str) -> MakeSettings:
    """Settings on this test's database and Redis, with a short schedule; schema at head."""
    upgrade(postgres_url)

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "data_dir": tmp_path / "data",
            "database_url": postgres_url,
            "redis_url": redis_url,
            "topic_prefix": f"t{uuid.uuid4().hex[:10]}",
            "webhook_allowlist": ["127.0.0.1"],
            "webhook_retry_schedule": [0.5, 1.5, 3.0],
            "webhook_dispatch_interval_s": 0.2,
            "webhook_timeout_s": 3.0,
            "webhook_connect_timeout_s": 1.0,
            "webhook_claim_s": 4.0,
            "webhook_concurrency": 2,
        }
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture
def sessions(postgres_url: str) -> Iterator[sessionmaker[Session]]:
    """Sessions on this test's database."""
    engine = create_db_engine(postgres_url)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


@pytest.fixture
def receiver(request: pytest.FixtureRequest) -> Iterator[WebhookReceiver]:
    """A loopback receiver; parametrize indirectly with its scripted replies."""
    with run_receiver(WebhookReceiver(getattr(request, "param", []))) as running:
        yield running


def finished_job_event(sessions: sessionmaker[Session], url: str) -> tuple[Job, Delivery, str]:
    """A tenant's job that just succeeded with a callback; its event and the secret."""
    with sessions() as session:
        tenant = create_tenant(session, name=f"acme-{uuid.uuid4().hex[:6]}")
        secret = ensure_webhook_secret(session, tenant_id=tenant.id).secret
        job = create_job(session, tenant_id=tenant.id, priority="normal", model="m",
                         kind="chat.completion", request=BODY, callback_url=url)
        assert complete_job(session, job_id=job.id, result=RESULT, prompt_tokens=5,
                            completion_tokens=2, cached_tokens=0, first_token_at=None)
        finished = get_job(session, job_id=job.id)
        assert finished is not None
        delivery = enqueue_job_event(session, job=finished)
        assert delivery is not None
        session.commit()
        return finished, delivery, secret


def wait_for_status(
    sessions: sessionmaker[Session], delivery_id: str, status: DeliveryStatus, timeout: float
) -> Delivery:
    """Poll the delivery row until it has `status`."""
    deadline = time.monotonic() + timeout
    while True:
        with sessions() as session:
            delivery = get_delivery(session, delivery_id=delivery_id)
            assert delivery is not None
            if delivery.status is status or time.monotonic() > deadline:
                assert delivery.status is status, f"delivery still {delivery.status}"
                return delivery
        time.sleep(0.1)


def others_after_a_marker(
    sessions: sessionmaker[Session], receiver: WebhookReceiver, timeout: float = 30
) -> list[ReceivedRequest]:
    """Every request the receiver got, but a marker's: an event enqueued now and awaited
    until it arrives. Its dispatch round came after everything before it was due, so a
    duplicate or a retry of an earlier event would have been sent by then."""
    _, marker, _ = finished_job_event(sessions, receiver.url)
    requests = receiver.wait_for_header("webhook-id", marker.webhook_id, timeout)
    return [r for r in requests if r.headers["webhook-id"] != marker.webhook_id]

def verify(secret: str, request: ReceivedRequest) -> dict[str, Any]:
    """The body, once `standardwebhooks` accepted the request's signature."""
    payload: dict[str, Any] = Webhook(secret).verify(request.body, request.headers)
    return payload


@pytest.mark.parametrize("receiver", [[Reply(status=204, body=b"")]], indirect=True)
def test_event_is_delivered_once_and_verifies(
    hook_settings: MakeSettings, sessions: sessionmaker[Session], receiver: WebhookReceiver,
    tmp_path: Path,
) -> None:
    job, delivery, secret = finished_job_event(sessions, receiver.url)
    with CallbacksWorker(hook_settings(), tmp_path / "worker.log") as worker:
        [request] = receiver.wait_for(1, timeout=30)
        done = wait_for_status(sessions, delivery.id, DeliveryStatus.SUCCEEDED, timeout=10)
        assert len(others_after_a_marker(sessions, receiver)) == 1, worker.log()  # not twice
    payload = verify(secret, request)
    assert request.headers["webhook-id"] == delivery.webhook_id
    assert payload["type"] == "job.succeeded"
    with sessions() as session:
        fresh = get_job(session, job_id=job.id)
        assert fresh is not None
        assert payload["data"] == job_event_data(fresh)
    assert payload["data"]["result"] == RESULT and payload["data"]["status"] == "succeeded"
    [attempt] = done.attempts
    assert attempt.status_code == 204 and attempt.error is None and attempt.latency_ms > 0
    assert attempt.webhook_timestamp == int(request.headers["webhook-timestamp"])


@pytest.mark.parametrize("receiver", [[Reply(status=500), Reply(status=503)]], indirect=True)
def test_two_failures_then_success_same_id_growing_delays(
    hook_settings: MakeSettings, sessions: sessionmaker[Session], receiver: WebhookReceiver,
    tmp_path: Path,
) -> None:
    settings = hook_settings()
    _, delivery, secret = finished_job_event(sessions, receiver.url)
    with CallbacksWorker(settings, tmp_path / "worker.log"):
        requests = receiver.wait_for(3, timeout=40)
        done = wait_for_status(sessions, delivery.id, DeliveryStatus.SUCCEEDED, timeout=10)
        assert len(others_after_a_marker(sessions, receiver)) == 3
    assert {r.headers["webhook-id"] for r in requests} == {delivery.webhook_id}
    for request in requests:
        verify(secret, request)
    assert [a.status_code for a in done.attempts] == [500, 503, 200]
    assert done.num_attempts == 3
    # A timestamp per attempt, as recorded; the first and last are seconds apart.
    stamps = [int(r.headers["webhook-timestamp"]) for r in requests]
    assert stamps == [a.webhook_timestamp for a in done.attempts]
    assert stamps[0] < stamps[2]
    # The scheduled delays (counted from the attempt's end) follow the schedule within
    # jitter, and grow. Above, they also hold the worker's own bookkeeping between the
    # attempt's end and the scheduling (a database session), which a busy machine
    # stretches: 0.4 s of slack still keeps each below the next entry's floor
    # (0.6 + 0.4 < 1.5 * 0.8 - 0.1 and 1.8 + 0.4 < 3.0 * 0.8 - 0.1), so a delay taken
    # from the wrong entry fails.
    slack = 0.4
    scheduled = [(a.next_attempt_at - a.attempted_at).total_seconds() - a.latency_ms / 1000
                 for a in done.attempts[:2] if a.next_attempt_at is not None]
    assert 0.5 * 0.8 - 0.1 <= scheduled[0] <= 0.5 * 1.2 + slack
    assert 1.5 * 0.8 - 0.1 <= scheduled[1] <= 1.5 * 1.2 + slack
    assert scheduled[0] < scheduled[1]
    # Each retry waited out its delay. (Not that the second gap is longer: a loaded machine
    # can hold up the first retry by more than the schedule grows.)
    gaps = [b.received_at - a.received_at for a, b in zip(requests, requests[1:], strict=False)]
    assert gaps[0] >= scheduled[0] - 0.05 and gaps[1] >= scheduled[1] - 0.05
    assert done.attempts[2].next_attempt_at is None


@pytest.mark.parametrize("receiver", [[Reply(status=410)]], indirect=True)
def test_gone_gets_exactly_one_attempt(
    hook_settings: MakeSettings, sessions: sessionmaker[Session], receiver: WebhookReceiver,
    tmp_path: Path,
) -> None:
    _, delivery, _ = finished_job_event(sessions, receiver.url)
    with CallbacksWorker(hook_settings(), tmp_path / "worker.log"):
        receiver.wait_for(1, timeout=30)
        done = wait_for_status(sessions, delivery.id, DeliveryStatus.FAILED, timeout=10)
        # The marker goes out once the first retry would have been due (the longest first
        # delay after the attempt's end): no retry came before it.
        [attempt] = done.attempts
        due = (attempt.attempted_at + timedelta(milliseconds=attempt.latency_ms)
               + timedelta(seconds=0.5 * 1.2))
        time.sleep(max(0.0, (due - utcnow()).total_seconds()))
        assert len(others_after_a_marker(sessions, receiver)) == 1
    assert [a.status_code for a in done.attempts] == [410]
    assert done.attempts[0].error is not None and "gone" in done.attempts[0].error
    with sessions() as session:
        again = get_delivery(session, delivery_id=delivery.id)
        assert again is not None and again.num_attempts == 1


def test_the_embedded_beat_exits_when_its_worker_is_killed(hook_settings: MakeSettings,
                                                          tmp_path: Path) -> None:
    """SIGKILL to the Celery worker alone: its beat, a forked child, leaves too rather than
    dispatching forever into a Redis that may be gone."""
    worker = CallbacksWorker(hook_settings(), tmp_path / "worker.log").start()
    try:
        main = psutil.Process(worker.pid)
        deadline = time.monotonic() + 60
        while not (beats := [child for child in main.children()
                             if "celery beat" in " ".join(child.cmdline())]):
            assert time.monotonic() < deadline, f"no beat process: {worker.log()}"
            time.sleep(0.2)
        os.kill(main.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(beats, timeout=30)
        assert not alive, f"the beat outlived its worker: {worker.log()[-3000:]}"
    finally:
        worker.stop()


@pytest.mark.parametrize("receiver", [[Reply(sleep_s=8.0)]], indirect=True)
def test_worker_killed_mid_delivery_loses_nothing(
    hook_settings: MakeSettings, sessions: sessionmaker[Session], receiver: WebhookReceiver,
    tmp_path: Path,
) -> None:
    settings = hook_settings(webhook_timeout_s=6.0, webhook_claim_s=7.0)
    _, delivery, secret = finished_job_event(sessions, receiver.url)
    worker = CallbacksWorker(settings, tmp_path / "worker.log").start()
    try:
        receiver.wait_for(1, timeout=30)  # the receiver now sleeps: the attempt is in flight
        worker.kill()
        with sessions() as session:
            pending = get_delivery(session, delivery_id=delivery.id)
            assert pending is not None and pending.status is DeliveryStatus.PENDING
            assert pending.attempts == []  # the killed attempt never finished
        worker.start()
        requests = receiver.wait_for(2, timeout=30)
        done = wait_for_status(sessions, delivery.id, DeliveryStatus.SUCCEEDED, timeout=10)
        assert len(others_after_a_marker(sessions, receiver)) == 2, worker.log()
    finally:
        worker.stop()
    assert [r.headers["webhook-id"] for r in requests] == [delivery.webhook_id] * 2
    verify(secret, requests[1])
    assert [a.status_code for a in done.attempts] == [200]


@pytest.fixture
def api_settings(settings: Callable[..., Settings]) -> Settings:
    """Settings on every real service (the API publishes to the broker); schema at head."""
    made = settings(webhook_allowlist=["127.0.0.1"], webhook_retry_schedule=[0.5, 1.5, 3.0],
                    webhook_dispatch_interval_s=0.2, webhook_timeout_s=3.0,
                    webhook_claim_s=4.0, webhook_concurrency=2)
    upgrade(made.database_url)
    return made


@pytest.fixture
def api_key(api_settings: Settings) -> str:
    """A tenant's API key on the test database."""
    engine = create_db_engine(api_settings.database_url)
    try:
        with session_factory(engine)() as session:
            tenant = create_tenant(session, name="acme")
            _, key = create_api_key(session, tenant_id=tenant.id)
            session.commit()
    finally:
        engine.dispose()
    return key


def test_cancelled_job_webhook_matches_get_then_retry_after_rotation(
    api_settings: Settings, api_key: str, receiver: WebhookReceiver, tmp_path: Path,
    sessions: sessionmaker[Session],
) -> None:
    auth = {"Authorization": f"Bearer {api_key}"}
    with TestClient(create_app(api_settings)) as client:
        submitted = client.post("/v1/jobs", headers=auth, json={
            "model": api_settings.model, "messages": BODY["messages"], "max_tokens": 4,
            "callback_url": receiver.url})
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth).status_code == 200
        # Cancelling again changes nothing and enqueues nothing.
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth).status_code == 200
        old_secret = client.get("/v1/webhook-secret", headers=auth).json()["secret"]

        with CallbacksWorker(api_settings, tmp_path / "worker.log"):
            [first] = receiver.wait_for(1, timeout=30)
            payload = verify(old_secret, first)
            assert payload["type"] == "job.cancelled"
            assert payload["data"] == client.get(f"/v1/jobs/{job_id}", headers=auth).json()
            listed = client.get(f"/v1/jobs/{job_id}/deliveries", headers=auth).json()["data"]
            assert len(listed) == 1
            delivery = listed[0]
            assert delivery["webhook_id"] == first.headers["webhook-id"]

            rotated = client.post("/v1/webhook-secret/rotate", headers=auth).json()
            assert rotated["previous_secret"] == old_secret != rotated["secret"]
            retried = client.post(f"/v1/deliveries/{delivery['id']}/retry", headers=auth)
            assert retried.status_code == 202
            requests = receiver.wait_for(2, timeout=30)
            assert len(others_after_a_marker(sessions, receiver)) == 2

        second = requests[1]
        assert second.headers["webhook-id"] == first.headers["webhook-id"]
        assert len(second.headers["webhook-signature"].split(" ")) == 2
        verify(rotated["secret"], second)
        verify(old_secret, second)
        [after] = client.get(f"/v1/jobs/{job_id}/deliveries", headers=auth).json()["data"]
        assert after["status"] == "succeeded" and after["num_attempts"] == 2
        assert [a["status_code"] for a in after["attempts"]] == [200, 200]
        assert client.post("/v1/deliveries/dlv_nope/retry", headers=auth).status_code == 404


@pytest.mark.parametrize("url", ["http://10.0.0.5/hook", "http://169.254.169.254/latest",
                                 "http://[::1]:8080/hook", "http://localhost/hook"])
def test_private_callback_url_is_refused_with_400(settings: Callable[..., Settings],
                                                  tmp_path: Path, url: str) -> None:
    made = settings()
    upgrade(made.database_url)
    engine = create_db_engine(made.database_url)
    with session_factory(engine)() as session:
        tenant = create_tenant(session, name="acme")
        _, key = create_api_key(session, tenant_id=tenant.id)
        session.commit()
    engine.dispose()
    auth = {"Authorization": f"Bearer {key}"}
    with TestClient(create_app(made)) as client:
        response = client.post("/v1/jobs", headers=auth, json={
            "model": made.model, "messages": BODY["messages"], "callback_url": url})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "callback_url"
        assert "public addresses only" in error["message"]
        assert client.get("/v1/jobs", headers=auth).json()["data"] == []


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama directory for a real inference worker (fast on a CPU)."""
    from tests.unit.engine.tiny_models import save_tiny_llama

    model_dir = tmp_path_factory.mktemp("tiny-llama-webhooks")
    save_tiny_llama(model_dir)
    return model_dir


@pytest.mark.parametrize("receiver", [[Reply(status=200)]], indirect=True)
def test_job_through_the_service_calls_back_once_with_what_get_shows(
    settings: Callable[..., Settings], tiny_model_dir: Path, receiver: WebhookReceiver,
    tmp_path: Path, sessions: sessionmaker[Session],
) -> None:
    made = settings(model=str(tiny_model_dir), topic_partitions=1,
                    kafka_session_timeout_ms=6000, worker_max_inflight=2,
                    engine_max_num_seqs=2, engine_kv_cache_memory_bytes=16 * 1024 * 1024,
                    webhook_allowlist=["127.0.0.1"], webhook_dispatch_interval_s=0.2,
                    webhook_timeout_s=3.0, webhook_claim_s=4.0, webhook_concurrency=2)
    upgrade(made.database_url)
    ensure_topics(made)
    engine = create_db_engine(made.database_url)
    with session_factory(engine)() as session:
        tenant = create_tenant(session, name="acme")
        _, key = create_api_key(session, tenant_id=tenant.id)
        secret = ensure_webhook_secret(session, tenant_id=tenant.id).secret
        session.commit()
    engine.dispose()
    auth = {"Authorization": f"Bearer {key}"}
    worker = WorkerProcess(made, tmp_path / "inference.log")
    try:
        with running_api(made) as base_url, httpx.Client(base_url=base_url,
                                                         headers=auth) as client, \
                CallbacksWorker(made, tmp_path / "callbacks.log"):
            submitted = client.post("/v1/jobs", json={
                "model": made.model, "messages": BODY["messages"], "max_tokens": 4,
                "temperature": 0, "callback_url": receiver.url})
            assert submitted.status_code == 202, submitted.text
            job_id = submitted.json()["id"]
            [request] = receiver.wait_for(1, timeout=180)
            assert len(others_after_a_marker(sessions, receiver)) == 1
            shown = client.get(f"/v1/jobs/{job_id}").json()
            deliveries = client.get(f"/v1/jobs/{job_id}/deliveries").json()["data"]
    finally:
        worker.stop()
    payload = verify(secret, request)
    assert payload["type"] == "job.succeeded"
    assert payload["data"] == shown and shown["status"] == "succeeded"
    assert payload["data"]["result"]["object"] == "chat.completion"
    [delivery] = deliveries
    assert delivery["status"] == "succeeded" and delivery["num_attempts"] == 1
    assert delivery["webhook_id"] == request.headers["webhook-id"]


def test_up_prints_the_webhook_secret_and_runs_the_callbacks_role(
    tmp_path: Path, receiver: WebhookReceiver
) -> None:
    run = start_up(tmp_path / "data", free_port(), num_workers=0, log_path=tmp_path / "up.log",
                   extra_env={"BATCHINFER_WEBHOOK_ALLOWLIST": "127.0.0.1"})
    try:
        line = run.wait_for_line("Webhook secret: ", 30)
        secret = line.removeprefix("Webhook secret: ").strip()
        with run.client() as client:
            assert client.get("/v1/webhook-secret").json()["secret"] == secret
            submitted = client.post("/v1/jobs", json={
                "model": "smollm2-135m-instruct", "messages": BODY["messages"],
                "callback_url": receiver.url})
            assert submitted.status_code == 202, submitted.text
            job_id = submitted.json()["id"]
            assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
            [request] = receiver.wait_for(1, timeout=60)
            shown = client.get(f"/v1/jobs/{job_id}").json()
        payload = verify(secret, request)
        assert payload["type"] == "job.cancelled" and payload["data"] == shown
        assert run.stop() == 0, run.log_tail()
    finally:
        if run.process.poll() is None:
            run.kill_tree()
