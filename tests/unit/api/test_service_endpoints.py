"""Health, readiness, metrics, models, and a 503 when the database is gone."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from tests.unit.api.conftest import MODEL, ClientFactory
from tests.utils.api import CHAT_BODY, TenantKey


def test_healthz_needs_nothing(client: TestClient) -> None:
    """Liveness answers without auth or dependencies."""
    assert client.get("/healthz").json() == {"status": "ok"}


def test_readyz_names_the_dependency_that_is_down(
        client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """No broker listens in these tests: 503 naming it, database and Redis fine."""
    # The ping of port 9 is refused, and retried until its timeout: keep that short.
    monkeypatch.setattr("api.routes.health.READY_CHECK_TIMEOUT_S", 0.3)
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["error"]["code"] == "not_ready"
    assert body["error"]["param"] == "broker"
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["redis"] == "ok"
    assert body["checks"]["broker"] != "ok"


def test_metrics_count_submissions_by_priority_and_http_latency(
    client: TestClient, acme: TenantKey
) -> None:
    """/metrics exposes submissions by priority and per-route latency."""
    # The registry is process-wide: count what this submission adds.
    low = {"priority": "low"}
    before = REGISTRY.get_sample_value("batchinfer_jobs_submitted_total", low) or 0.0
    response = client.post("/v1/jobs", json={"model": MODEL, **CHAT_BODY, "priority": "low"},
                           headers=acme.headers)
    assert response.status_code == 202, response.text
    assert REGISTRY.get_sample_value("batchinfer_jobs_submitted_total", low) == before + 1
    text = client.get("/metrics").text
    assert 'batchinfer_jobs_submitted_total{priority="low"}' in text
    assert 'route="/v1/jobs"' in text
    assert "batchinfer_http_request_seconds_bucket" in text


def test_models_lists_what_is_served(make_client: ClientFactory, acme: TenantKey) -> None:
    """GET /v1/models lists served_models; a model outside it is 404 model_not_found."""
    client = make_client(served_models=[MODEL, "other"])
    listing = client.get("/v1/models", headers=acme.headers).json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == [MODEL, "other"]
    assert client.get("/v1/models/other", headers=acme.headers).json()["object"] == "model"
    missing = client.get("/v1/models/gpt-4", headers=acme.headers)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_database_down_is_503(make_client: ClientFactory) -> None:
    """An unreachable database: authenticated routes answer 503 naming it."""
    client = make_client(database_url="postgresql+psycopg://u:p@127.0.0.1:9/none")
    body: dict[str, Any] = {"model": MODEL, **CHAT_BODY}
    response = client.post("/v1/jobs", json=body, headers={"Authorization": "Bearer bi_x"})
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"
    assert "database" in response.json()["error"]["message"]
    assert "Retry-After" in response.headers
