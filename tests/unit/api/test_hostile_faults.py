"""One fault test per hostile-input defect found against a running service.

Each failed on the code before its fix: a body nested 1,000 deep was a plain-text 500
with a traceback per request (before the key was even checked); an exception in a
route printed a traceback per request through the server; and the rest as named.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

import api.routes.models
from core.json_bounds import MAX_JSON_DEPTH, MAX_JSON_VALUES
from tests.unit.api.conftest import MODEL
from tests.unit.api.test_requests_refused import assert_error_shape
from tests.utils.api import RecordingProducer, TenantKey, count_jobs

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4}
JSON_PATHS = ["/v1/jobs", "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
              "/v1/batches"]
JSON = {"Content-Type": "application/json"}


def nested(depth: int, *, opener: bytes = b"[", closer: bytes = b"]") -> bytes:
    """A chat body whose metadata nests `depth` levels deep."""
    return (b'{"model": "test-model", "messages": [{"role": "user", "content": "hi"}], '
            b'"metadata": ' + opener * depth + closer * depth + b"}")


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Records that carry a traceback (whoever logged them)."""
    return [r for r in caplog.records if r.exc_info]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000, 100_000])
@pytest.mark.parametrize("path", JSON_PATHS)
@pytest.mark.parametrize("authorized", [True, False], ids=["key", "no-key"])
def test_a_body_nested_too_deep_is_a_400_in_the_error_shape(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, caplog: pytest.LogCaptureFixture, depth: int, path: str,
    authorized: bool,
) -> None:
    """No recursion, no 500, no traceback; the same answer with or without a key."""
    headers = JSON | (acme.headers if authorized else {})
    with caplog.at_level(logging.INFO):
        response = client.post(path, content=nested(depth), headers=headers)
    assert response.status_code == 400, response.text
    error = assert_error_shape(response.json())
    assert error["code"] == "json_too_complex"
    assert f"deeper than {MAX_JSON_DEPTH}" in error["message"]
    assert tracebacks(caplog) == []
    assert count_jobs(sessions) == 0
    assert producer.records == []


def test_a_body_at_the_depth_limit_is_read_as_usual(
    client: TestClient, acme: TenantKey, producer: RecordingProducer,
) -> None:
    """The bound is not a cut below what it says: 64 levels parse (and metadata must be
    an object of strings, so this one is the schema's 400, not the guard's 400)."""
    response = client.post("/v1/jobs", content=nested(MAX_JSON_DEPTH - 1),
                           headers=JSON | acme.headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "metadata"


def test_a_body_of_too_many_values_is_a_400(
    make_client: Any, acme: TenantKey, sessions: sessionmaker[Session],
) -> None:
    client = make_client(max_request_bytes=4 * MAX_JSON_VALUES)
    body = b'{"model": "m", "prompt": [' + b"0," * MAX_JSON_VALUES + b"0]}"
    response = client.post("/v1/completions", content=body, headers=JSON | acme.headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "json_too_complex"
    assert count_jobs(sessions) == 0


def test_an_exception_in_a_route_is_a_shaped_500_logged_once_and_counted(
    client: TestClient, acme: TenantKey, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Twenty requests that crash the same route: twenty 500s, one traceback."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(api.routes.models, "_cards", broken)
    before = _metric(client, 'batchinfer_http_unexpected_errors_total{error="ZeroDivisionError"}')
    with caplog.at_level(logging.INFO):
        answers = [client.get("/v1/models", headers=acme.headers) for _ in range(20)]
    assert {r.status_code for r in answers} == {500}
    for response in answers:
        assert assert_error_shape(response.json())["code"] == "internal_error"
    assert len(tracebacks(caplog)) == 1
    after = _metric(client, 'batchinfer_http_unexpected_errors_total{error="ZeroDivisionError"}')
    assert after == before + 20
    assert 'route="/v1/models",status="500"' in client.get("/metrics").text


def test_an_exception_on_the_hot_path_is_logged_once_not_raised(
    client: TestClient, acme: TenantKey, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise LookupError("a bug")

    monkeypatch.setattr("api.hot_path.accept_job", broken)
    with caplog.at_level(logging.INFO):
        answers = [client.post("/v1/jobs", json=CHAT, headers=acme.headers)
                   for _ in range(20)]
    assert {r.status_code for r in answers} == {500}
    assert len(tracebacks(caplog)) == 1


def _metric(client: TestClient, series: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def test_readyz_names_what_is_down_never_where_it_lives(
    make_client: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Unauthenticated: no host, port, URL or error text in the answer (the log has them)."""
    monkeypatch.setattr("api.routes.health.READY_CHECK_TIMEOUT_S", 0.3)
    client = make_client(redis_url="redis://127.0.0.1:1/0",
                         kafka_bootstrap_servers="broker.internal.example:9")
    with caplog.at_level(logging.WARNING):
        response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["broker"] != "ok" and body["checks"]["redis"] != "ok"
    text = response.text
    for secret in ("127.0.0.1", "broker.internal", "redis://", ":9", ":1"):
        assert secret not in text, text
    assert "redis" in body["error"]["param"] and "broker" in body["error"]["param"]
