"""Refused requests: auth, validation, unsupported features, size. Nothing is written."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from storage.models import ApiKey
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.utils.api import CHAT_BODY, RecordingProducer, TenantKey, count_jobs

VALID: dict[str, Any] = {"model": MODEL, **CHAT_BODY}


def assert_error_shape(body: dict[str, Any]) -> dict[str, Any]:
    """The one error shape: exactly message, type, param, code under `error`."""
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_missing_key_is_401_with_www_authenticate(client: TestClient) -> None:
    """No Authorization header: 401, a Bearer challenge, the error shape."""
    response = client.post("/v1/jobs", json=VALID)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert assert_error_shape(response.json())["code"] == "missing_api_key"


def test_wrong_and_revoked_keys_are_401(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session]
) -> None:
    """An unknown key, and a key once valid but revoked, are refused alike."""
    response = client.get("/v1/jobs", headers={"Authorization": "Bearer bi_nope"})
    assert response.status_code == 401
    assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]
    assert client.get("/v1/jobs", headers=acme.headers).status_code == 200
    with sessions() as session:
        from storage.tenants import revoke_api_key
        key = session.query(ApiKey).filter_by(tenant_id=acme.tenant_id).one()
        revoke_api_key(session, key_id=key.id)
        session.commit()
    assert client.get("/v1/jobs", headers=acme.headers).status_code == 401


@pytest.mark.parametrize(("patch", "status", "param"), [
    ({"temperature": 3}, 400, "temperature"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"model": None}, 400, "model"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ({"callback_url": "file:///etc/passwd"}, 400, "callback_url"),
    ({"surprise": True}, 400, "surprise"),
    ({"priority": "urgent"}, 400, "priority"),
    ({"stream": True}, 400, "stream"),
    ({"n": 129}, 400, "n"),
    ({"top_logprobs": 5}, 400, "top_logprobs"),
    ({"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"callback_url": "http://10.1.2.3/hook"}, 400, "callback_url"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
     "messages[0].content[0].type"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": {"not a name": 1}}, 400, "chat_template_kwargs.not a name"),
    ({"chat_template_kwargs": {"k": 1}, "messages": None, "prompt": "hi"}, 400,
     "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, 400, "chat_template_kwargs"),
    ({"echo": True}, 400, "echo"),  # a chat request has no prompt to echo
])
def test_bad_payloads_name_the_field_and_write_nothing(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, patch: dict[str, Any], status: int, param: str,
) -> None:
    """Shape errors are 400, unsupported ones 400, unknown models 404; no row, no message."""
    body = {k: v for k, v in (VALID | patch).items() if v is not None}
    response = client.post("/v1/jobs", json=body, headers=acme.headers)
    assert response.status_code == status, response.text
    error = assert_error_shape(response.json())
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert count_jobs(sessions) == 0
    assert producer.records == []


def test_echo_is_not_streamed(client: TestClient, acme: TenantKey,
                              sessions: sessionmaker[Session]) -> None:
    """`echo` shows the prompt in the result's text, which a stream's chunks would not."""
    response = client.post("/v1/completions", json={
        "model": MODEL, "prompt": "hi", "echo": True, "stream": True}, headers=acme.headers)
    assert response.status_code == 400
    assert assert_error_shape(response.json())["param"] == "echo"
    assert count_jobs(sessions) == 0


def test_missing_field_message_names_it(client: TestClient, acme: TenantKey) -> None:
    """A missing required field is named in the message too."""
    response = client.post("/v1/chat/completions", json={"model": MODEL}, headers=acme.headers)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Missing required parameter: 'messages'."


def test_stream_options_without_a_stream_or_unknown_are_400(
        client: TestClient, acme: TenantKey, sessions: sessionmaker[Session]) -> None:
    """Streaming is served, logprobs included (tests/integration/test_streaming.py), and
    stream_options only with a stream and include_usage."""
    for path, body in (("/v1/chat/completions", VALID),
                       ("/v1/completions", {"model": MODEL, "prompt": "hi"})):
        for extra, param in (({"stream_options": {"include_usage": True}}, "stream_options"),
                             ({"stream": True, "stream_options": {"x": 1}},
                              "stream_options.x")):
            response = client.post(path, json=body | extra, headers=acme.headers)
            assert response.status_code == 400, (path, extra)
            assert assert_error_shape(response.json())["param"] == param
    assert count_jobs(sessions) == 0


def test_unparseable_and_non_object_bodies_are_400(client: TestClient, acme: TenantKey) -> None:
    """Broken JSON, and JSON that is not an object, get a 400 saying so."""
    headers = acme.headers | {"Content-Type": "application/json"}
    broken = client.post("/v1/jobs", content=b'{"model": ', headers=headers)
    assert broken.status_code == 400
    assert assert_error_shape(broken.json())["code"] == "invalid_json"
    not_object = client.post("/v1/jobs", content=b"[1, 2]", headers=headers)
    assert not_object.status_code == 400
    assert "JSON object" in not_object.json()["error"]["message"]
    # Bytes that are no UTF-8 (FastAPI's own refusal on its routes, the hot path's on jobs).
    latin = b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    for path in ("/v1/jobs", "/v1/chat/completions"):
        undecodable = client.post(path, content=latin, headers=headers)
        assert undecodable.status_code == 400, path
        assert assert_error_shape(undecodable.json())["code"] == "invalid_json", (
            path, undecodable.text)


def test_oversized_bodies_are_413_before_parsing(
    make_client: ClientFactory, acme: TenantKey, sessions: sessionmaker[Session]
) -> None:
    """Over max_request_bytes: 413 by Content-Length, and by counting a chunked body."""
    client = make_client(max_request_bytes=2048)
    headers = acme.headers | {"Content-Type": "application/json"}
    big = b'{"model": "' + b"x" * 4096 + b'"}'
    declared = client.post("/v1/jobs", content=big, headers=headers)
    assert declared.status_code == 413
    assert "2048 bytes" in assert_error_shape(declared.json())["message"]

    def chunks() -> Any:
        for i in range(0, len(big), 512):
            yield big[i:i + 512]

    streamed = client.post("/v1/jobs", content=chunks(), headers=headers)
    assert streamed.status_code == 413
    assert assert_error_shape(streamed.json())["code"] == "request_too_large"
    assert count_jobs(sessions) == 0


def test_unknown_urls_and_methods_use_the_error_shape(client: TestClient) -> None:
    """The framework's own 404 and 405 come in the same shape."""
    missing = client.get("/v1/nothing")
    assert missing.status_code == 404
    assert assert_error_shape(missing.json())["code"] == "unknown_url"
    wrong = client.delete("/v1/jobs")
    assert wrong.status_code == 405
    assert_error_shape(wrong.json())


def test_invalid_query_parameters_are_400(client: TestClient, acme: TenantKey) -> None:
    """limit out of range, an unknown status and a time past what a date can hold (a 500
    once) name the query parameter."""
    for url, param in (("/v1/jobs?limit=0", "limit"), ("/v1/jobs?limit=101", "limit"),
                       ("/v1/jobs?status=done", "status"),
                       ("/v1/jobs?created_after=99999999999999", "created_after"),
                       ("/v1/jobs?created_before=253402300800", "created_before"),
                       ("/v1/usage?start=100000000000000000000", "start"),
                       ("/v1/usage?end=99999999999999", "end")):
        response = client.get(url, headers=acme.headers)
        assert response.status_code == 400, (url, response.text)
        assert response.json()["error"]["param"] == param
    latest = client.get("/v1/usage?start=0&end=253402300799", headers=acme.headers)
    assert latest.status_code == 200, latest.text
    bad_wait = client.get("/v1/jobs/job_x?wait=-1", headers=acme.headers)
    assert bad_wait.status_code == 400
