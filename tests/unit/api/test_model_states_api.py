"""Model states through the API: `GET /v1/models`, `/readyz`, and 503 for a failed model."""

from __future__ import annotations

import time

import redis
from fastapi.testclient import TestClient

from storage.model_states import (
    MAX_LOAD_FAILURES,
    beat_worker,
    record_load_failure,
    record_load_success,
    remove_worker,
)
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.utils.api import RecordingProducer, TenantKey

JOB = {"model": MODEL, "prompt": "hi"}


def _redis(client: TestClient) -> tuple[redis.Redis, str]:
    settings = client.app.state.resources.settings  # type: ignore[attr-defined]
    return redis.Redis.from_url(settings.redis_url), settings.topic_prefix


def _models(client: TestClient, acme: TenantKey) -> dict[str, dict[str, object]]:
    listing = client.get("/v1/models", headers=acme.headers).json()
    return {m["id"]: m for m in listing["data"]}


def test_a_model_moves_from_loading_to_ready_and_back(make_client: ClientFactory,
                                                      acme: TenantKey) -> None:
    """No worker yet: loading, not ready in /readyz. A worker that consumes makes it ready
    with one live worker; one that stops (or whose beats are older than the heartbeat
    timeout) leaves it loading again."""
    client = make_client(served_models=[MODEL, "emb"], embedding_models=["emb"],
                         worker_heartbeat_timeout_s=30.0)
    r, prefix = _redis(client)
    models = _models(client, acme)
    assert (models[MODEL]["state"], models[MODEL]["live_workers"]) == ("loading", 0)
    ready = client.get("/readyz").json()
    assert ready["models_not_ready"] == [MODEL, "emb"]

    beat_worker(r, prefix=prefix, name=MODEL, worker_id="w1")
    beat_worker(r, prefix=prefix, name=MODEL, worker_id="w2", now=time.time() - 31)  # dead
    models = _models(client, acme)
    assert (models[MODEL]["state"], models[MODEL]["live_workers"]) == ("ready", 1)
    assert models["emb"]["state"] == "loading"
    ready = client.get("/readyz").json()
    assert ready["models_not_ready"] == ["emb"]
    # Unauthenticated: the state, never a load error's text.
    assert ready["models"][MODEL] == {"state": "ready", "live_workers": 1}

    remove_worker(r, prefix=prefix, name=MODEL, worker_id="w1")
    assert client.get(f"/v1/models/{MODEL}", headers=acme.headers).json()["state"] == "loading"
    r.close()


def test_a_model_that_fails_to_load_refuses_new_jobs_and_keeps_queued_ones(
        make_client: ClientFactory, acme: TenantKey, producer: RecordingProducer) -> None:
    """Fewer failed loads than the limit: still loading, jobs accepted. At the limit: the
    model is failed with the error, new jobs get 503 model_unavailable naming it, the job
    accepted before is still queued. A load that then succeeds takes jobs again."""
    client = make_client()
    r, prefix = _redis(client)
    error = "ValueError: model directory /m/x has no .safetensors files"
    for _ in range(MAX_LOAD_FAILURES - 1):
        record_load_failure(r, prefix=prefix, name=MODEL, error=error)
    queued = client.post("/v1/jobs", headers=acme.headers, json=JOB)
    assert queued.status_code == 202
    assert _models(client, acme)[MODEL]["state"] == "loading"

    record_load_failure(r, prefix=prefix, name=MODEL, error=error)
    model = _models(client, acme)[MODEL]
    assert (model["state"], model["live_workers"], model["error"]) == ("failed", 0, error)
    deadline = time.monotonic() + 10  # the submission path re-reads states every second
    while (refused := client.post("/v1/jobs", headers=acme.headers, json=JOB)).status_code \
            == 202 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert refused.status_code == 503
    body = refused.json()["error"]
    assert (body["code"], body["param"]) == ("model_unavailable", "model")
    assert error in body["message"]
    assert refused.headers["Retry-After"] == "30"
    job = client.get(f"/v1/jobs/{queued.json()['id']}", headers=acme.headers).json()
    assert job["status"] == "queued"

    record_load_success(r, prefix=prefix, name=MODEL)
    deadline = time.monotonic() + 10
    while (accepted := client.post("/v1/jobs", headers=acme.headers, json=JOB)).status_code \
            != 202 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert accepted.status_code == 202
    r.close()


def test_a_batch_for_a_failed_model_is_refused(make_client: ClientFactory,
                                               acme: TenantKey) -> None:
    """A batch whose `model` failed to load: 503 model_unavailable, no batch created; the
    same batch once the model loads again is accepted."""
    from tests.unit.api.test_files_batches_api import create, upload

    client = make_client()
    r, prefix = _redis(client)
    for _ in range(MAX_LOAD_FAILURES):
        record_load_failure(r, prefix=prefix, name=MODEL, error="OSError: disk gone")
    file_id = upload(client, acme).json()["id"]
    refused = create(client, acme, file_id, model=MODEL)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "model_unavailable"
    assert "OSError: disk gone" in refused.json()["error"]["message"]
    assert client.get("/v1/batches", headers=acme.headers).json()["data"] == []
    record_load_success(r, prefix=prefix, name=MODEL)
    assert create(client, acme, file_id, model=MODEL).status_code == 200
    r.close()
