"""The hot path answers ordinary job submissions and reads exactly as FastAPI's routes do.

Each case is sent twice: as `application/json` (ordinary: the hot path answers it) and
as `application/vnd.batchinfer+json`, which FastAPI reads as JSON too but the hot path
hands on, so the route answers it. The two answers must match, and the hot path must
have answered the first.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

import api.hot_path
from api.hot_path import ordinary_read, ordinary_submission
from tests.unit.api.conftest import MODEL
from tests.utils.api import CHAT_BODY, TenantKey

VALID: dict[str, Any] = {"model": MODEL, **CHAT_BODY}
HOT = "application/json"
ROUTE = "application/vnd.batchinfer+json"


@pytest.fixture
def hot_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the route functions the hot path called (the routes' calls not)."""
    calls: list[str] = []
    for name in ("accept_job", "job_response"):
        real = getattr(api.hot_path, name)

        async def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any
                          ) -> Any:
            calls.append(_name)
            return await _real(*args, **kwargs)

        monkeypatch.setattr(api.hot_path, name, counted)
    return calls


def comparable(response: Any) -> tuple[int, Any, str | None]:
    """Status, body and Location, with what differs between two new jobs left out."""
    body = response.json()
    if "id" in body:
        body = {k: v for k, v in body.items() if k not in ("id", "links", "created_at")}
    location = response.headers.get("location")
    return response.status_code, body, location and location.rpartition("/")[0]


BODIES: dict[str, dict[str, Any]] = {
    "valid": VALID,
    "low priority with metadata": {**VALID, "priority": "low", "metadata": {"run": "7"}},
    "unknown field": {**VALID, "bogus": 1},
    "missing messages": {"model": MODEL},
    "negative max_tokens": {**VALID, "max_tokens": -1},
    "messages not a list": {**VALID, "messages": "hi"},
    "unknown model": {**VALID, "model": "no-such-model"},
    "unknown priority": {**VALID, "priority": "urgent"},
    "callback host not allowed": {**VALID, "callback_url": "https://example.invalid/h"},
    "embedding on a chat model": {"model": MODEL, "input": "hi"},
}


@pytest.mark.parametrize("name", list(BODIES))
def test_a_submission_is_answered_as_the_route_answers_it(
        client: TestClient, acme: TenantKey, hot_calls: list[str], name: str) -> None:
    answers = [comparable(client.post("/v1/jobs", content=_json(BODIES[name]),
                                      headers={**acme.headers, "Content-Type": kind}))
               for kind in (HOT, ROUTE)]
    assert answers[0] == answers[1]
    assert hot_calls == ["accept_job"]


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer bi_unknown"},
    {"Authorization": "Basic dXNlcjpwYXNz"},
    {"Authorization": "Bearer"},
], ids=["no key", "unknown key", "another scheme", "empty bearer"])
def test_who_is_calling_is_judged_as_the_route_judges_it(
        client: TestClient, hot_calls: list[str], headers: dict[str, str]) -> None:
    answers = [client.post("/v1/jobs", content=_json(VALID),
                           headers={**headers, "Content-Type": kind}) for kind in (HOT, ROUTE)]
    assert answers[0].status_code == answers[1].status_code == 401
    assert answers[0].json() == answers[1].json()
    assert answers[0].headers["www-authenticate"] == answers[1].headers["www-authenticate"]
    assert hot_calls == []  # refused before the route's work


def test_idempotency_keys_replay_and_conflict_alike(
        client: TestClient, acme: TenantKey, hot_calls: list[str]) -> None:
    for kind in (HOT, ROUTE):
        headers = {**acme.headers, "Content-Type": kind, "Idempotency-Key": f"k-{kind}"}
        first = client.post("/v1/jobs", content=_json(VALID), headers=headers)
        again = client.post("/v1/jobs", content=_json(VALID), headers=headers)
        other = client.post("/v1/jobs", content=_json({**VALID, "max_tokens": 9}),
                            headers=headers)
        assert (first.status_code, again.status_code, other.status_code) == (202, 200, 409)
        assert again.json()["id"] == first.json()["id"]
        assert again.headers["idempotent-replayed"] == "true"
        assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert hot_calls == ["accept_job"] * 3


@pytest.mark.parametrize(("content", "headers"), [
    (b"[1, 2]", {"Content-Type": HOT}),
    (b"{", {"Content-Type": HOT}),
    (_body := b'{"model": "x"}', {}),
    (_body, {"Content-Type": "text/plain"}),
    (_body, {"Content-Type": HOT, "Idempotency-Key": ""}),
    (_body, {"Content-Type": HOT, "Idempotency-Key": "k" * 201}),
], ids=["array", "broken", "no content type", "text", "empty key", "long key"])
def test_what_is_not_ordinary_goes_to_the_route(
        client: TestClient, acme: TenantKey, hot_calls: list[str], content: bytes,
        headers: dict[str, str]) -> None:
    """FastAPI answers these (400 or 400 in the one error shape); the hot path does not."""
    response = client.post("/v1/jobs", content=content, headers={**acme.headers, **headers})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert hot_calls == []


def test_a_read_is_answered_as_the_route_answers_it(
        client: TestClient, acme: TenantKey, hot_calls: list[str]) -> None:
    job_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    hot_calls.clear()
    hot = client.get(f"/v1/jobs/{job_id}?wait=0.2", headers=acme.headers)
    routed = client.get(f"/v1/jobs/{job_id}?wait=0.2&also=1", headers=acme.headers)
    assert hot.status_code == routed.status_code == 200
    assert hot.json() == routed.json()
    assert hot.json()["status"] == "queued"
    missing = [client.get(f"/v1/jobs/job_nope{query}", headers=acme.headers)
               for query in ("", "?wait=0&also=1")]
    assert missing[0].status_code == missing[1].status_code == 404
    assert missing[0].json() == missing[1].json()
    assert hot_calls == ["job_response", "job_response"]


def test_a_read_of_another_tenants_job_is_not_found(
        client: TestClient, acme: TenantKey, globex: TenantKey) -> None:
    job_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    response = client.get(f"/v1/jobs/{job_id}", headers=globex.headers)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "job_not_found"


def _num_requests(method: str, route: str, status: str) -> float:
    """Requests the process-wide registry counted under these labels so far."""
    labels = {"method": method, "route": route, "status": status}
    return REGISTRY.get_sample_value("batchinfer_http_request_seconds_count", labels) or 0.0


def test_metrics_label_hot_requests_by_their_route(client: TestClient, acme: TenantKey,
                                                   hot_calls: list[str]) -> None:
    # Counted by this test's requests: the registry is shared with earlier tests.
    before = (_num_requests("POST", "/v1/jobs", "202"),
              _num_requests("GET", "/v1/jobs/{job_id}", "200"))
    job_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    client.get(f"/v1/jobs/{job_id}", headers=acme.headers)
    assert hot_calls == ["accept_job", "job_response"]
    after = (_num_requests("POST", "/v1/jobs", "202"),
             _num_requests("GET", "/v1/jobs/{job_id}", "200"))
    assert (after[0] - before[0], after[1] - before[1]) == (1.0, 1.0)
    text = client.get("/metrics").text
    assert 'method="POST",route="/v1/jobs",status="202"' in text


def test_an_unexpected_error_is_the_apps_500_and_counted(
        client: TestClient, acme: TenantKey, monkeypatch: pytest.MonkeyPatch) -> None:
    """What no handler takes is the one error shape's 500, as the routes' would be."""

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(api.hot_path, "accept_job", broken)
    response = client.post("/v1/jobs", content=_json(VALID),
                           headers={**acme.headers, "Content-Type": HOT})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert 'method="POST",route="/v1/jobs",status="500"' in client.get("/metrics").text


def test_a_chunked_body_goes_to_the_route(
        client: TestClient, acme: TenantKey, hot_calls: list[str]) -> None:
    """Without a Content-Length the body limit is the route's to count."""
    response = client.post("/v1/jobs", content=iter([_json(VALID)]),
                           headers={**acme.headers, "Content-Type": HOT})
    assert response.status_code == 202
    assert "content-length" not in response.request.headers
    assert hot_calls == []


def test_with_fastapis_telemetry_on_everything_goes_through_fastapi(
        client: TestClient, acme: TenantKey, hot_calls: list[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A configured OpenTelemetry provider gets its spans for these routes too."""
    app: Any = client.app
    telemetry = getattr(app, "_native_telemetry", None)
    if telemetry is None:
        pytest.skip("this FastAPI has no native telemetry")
    monkeypatch.setattr(telemetry, "enabled", lambda: True)
    monkeypatch.setattr(app.hot_path, "_traced_until", 0.0)  # an earlier finding is stale
    monkeypatch.setattr(type(telemetry), "__call__", _untraced)
    response = client.post("/v1/jobs", content=_json(VALID),
                           headers={**acme.headers, "Content-Type": HOT})
    assert response.status_code == 202
    assert hot_calls == []


async def _untraced(self: Any, *, app: Any, scope: Any, receive: Any, send: Any,
                    legacy_otel: bool) -> None:
    """FastAPI's telemetry wrapper, minus the spans (no provider is configured here)."""
    await app(scope, receive, send)


@pytest.mark.parametrize(("content_type", "key", "body", "expected"), [
    ("application/json", None, b'{"a": 1}', {"a": 1}),
    ("Application/JSON; charset=utf-8", "k", b'{"a": 1}', {"a": 1}),
    (None, None, b'{"a": 1}', None),
    ("application/problem+json", None, b'{"a": 1}', None),
    ("application/json", "", b'{"a": 1}', None),
    ("application/json", "k" * 200, b"{}", {}),
    ("application/json", "k" * 201, b"{}", None),
    ("application/json", None, b'"text"', None),
    ("application/json", None, b"{", None),
    # Read as FastAPI reads JSON (the standard library), whatever it holds:
    ("application/json", None, b'{"a": 18446744073709551616}', {"a": 18446744073709551616}),
    ("application/json", None, b'{"a": NaN}', {"a": pytest.approx(float("nan"), nan_ok=True)}),
    ("application/json", None, b'{"a": "\\ud800"}', {"a": "\ud800"}),
    ("application/json", None, "{}".encode("utf-16"), {}),
])
def test_which_submissions_are_ordinary(content_type: str | None, key: str | None,
                                        body: bytes, expected: dict[str, Any] | None) -> None:
    assert ordinary_submission(content_type, key, body) == expected


@pytest.mark.parametrize(("job_id", "query", "expected"), [
    ("job_1", b"", 0.0),
    ("job_1", b"wait=30", 30.0),
    ("job_1", b"wait=0.25", 0.25),
    ("job_1", b"wait=-1", None),
    ("job_1", b"wait=nan", None),
    ("job_1", b"wait=1e3", None),
    ("job_1", b"wait=%31", None),
    ("job_1", b"wait=1&wait=2", None),
    ("job_1", b"other=1", None),
    ("job_1/cancel", b"", None),
    ("", b"", None),
])
def test_which_reads_are_ordinary(job_id: str, query: bytes, expected: float | None) -> None:
    assert ordinary_read(job_id, query) == expected


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()
