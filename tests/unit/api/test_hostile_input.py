"""Hostile input through every submission endpoint: a 4xx naming the field, nothing written.

Lone surrogates anywhere a client can put text, lax types OpenAI refuses (`"8"`, `true`,
`1e30` for an integer), non-finite numbers, an over-long Idempotency-Key. Each refusal is
checked for its status, its `param`, and that no job row and no broker record exist.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.submission import request_hash
from core.messages import JobMessage, prompt_affinity_key
from core.requests import JobCreate
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.unit.api.hostile_cases import (
    CHAT_ONLY_STRICT_CASES,
    CHAT_TEXT_CASES,
    JOB_TEXT_CASES,
    LONE,
    PROMPT_TEXT_CASES,
    STRICT_CASES,
    send_json,
)
from tests.unit.api.test_requests_refused import assert_error_shape
from tests.utils.api import RecordingProducer, TenantKey, count_jobs

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4}
TEXT: dict[str, Any] = {"model": MODEL, "prompt": "Once", "max_tokens": 4}
# (path, valid body) for each entry point that takes a chat request, and a text one.
CHAT_PATHS = [("/v1/jobs", CHAT), ("/v1/chat/completions", CHAT)]
TEXT_PATHS = [("/v1/jobs", TEXT), ("/v1/completions", TEXT)]


def assert_refused(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, path: str, body: dict[str, Any], *, status: int, param: str,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """POST, expect `status` naming `param`, and check nothing was stored or produced."""
    response = send_json(client, path, body, acme.headers | (headers or {}))
    assert response.status_code == status, response.text
    error = assert_error_shape(response.json())
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert count_jobs(sessions) == 0
    assert producer.records == []
    return error


@pytest.mark.parametrize("path_body", CHAT_PATHS, ids=lambda p: p[0])
@pytest.mark.parametrize(("patch", "param"), CHAT_TEXT_CASES + [({"model": LONE}, "model")])
def test_lone_surrogates_in_chat_requests_are_400_naming_the_field(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, path_body: tuple[str, dict[str, Any]],
    patch: dict[str, Any], param: str,
) -> None:
    """`"x\\ud800y"` in any text field: 400 naming it (escaped where it is the name itself)."""
    path, body = path_body
    error = assert_refused(client, acme, sessions, producer, path, body | patch, status=400,
                           param=param)
    if param.startswith(("messages", "stop", "user", "model")):
        assert "surrogate" in error["message"]


@pytest.mark.parametrize("path_body", TEXT_PATHS, ids=lambda p: p[0])
@pytest.mark.parametrize(("patch", "param"), PROMPT_TEXT_CASES)
def test_lone_surrogates_in_text_requests_are_400_naming_the_field(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, path_body: tuple[str, dict[str, Any]],
    patch: dict[str, Any], param: str,
) -> None:
    """The prompt, stop strings and a completion's suffix are checked alike."""
    path, body = path_body
    error = assert_refused(client, acme, sessions, producer, path, body | patch, status=400,
                           param=param)
    if param != "suffix" or path == "/v1/completions":  # /v1/jobs has no suffix field
        assert "U+D800" in error["message"]


@pytest.mark.parametrize(("patch", "param"), JOB_TEXT_CASES + [
    ({"callback_url": "http://127.0.0.1/hook/" + LONE}, "callback_url"),
])
def test_lone_surrogates_in_job_metadata_and_callback_are_400(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, patch: dict[str, Any], param: str,
) -> None:
    """Metadata keys and values, and the callback URL, of /v1/jobs."""
    assert_refused(client, acme, sessions, producer, "/v1/jobs", CHAT | patch, status=400,
                   param=param)


@pytest.mark.parametrize("path_body", CHAT_PATHS + TEXT_PATHS[1:], ids=lambda p: p[0])
@pytest.mark.parametrize(("patch", "param"), STRICT_CASES)
def test_lax_types_and_non_finite_numbers_are_400(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, path_body: tuple[str, dict[str, Any]],
    patch: dict[str, Any], param: str,
) -> None:
    """Integers are JSON integers, booleans booleans, numbers finite: as OpenAI is strict."""
    path, body = path_body
    error = assert_refused(client, acme, sessions, producer, path, body | patch, status=400,
                           param=param)
    if patch.get(param) != patch.get(param):  # NaN
        assert "finite number" in error["message"]
        assert "<=" not in error["message"]


@pytest.mark.parametrize(("patch", "param"), CHAT_ONLY_STRICT_CASES)
def test_unknown_roles_and_non_text_content_are_400(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, patch: dict[str, Any], param: str,
) -> None:
    """A `robot` role, a number for content."""
    for path, body in CHAT_PATHS:
        assert_refused(client, acme, sessions, producer, path, body | patch, status=400,
                       param=param)


def test_empty_prompt_is_400(client: TestClient, acme: TenantKey,
                             sessions: sessionmaker[Session], producer: RecordingProducer) -> None:
    """The worker cannot run an empty prompt, so it is refused at once."""
    for path, body in TEXT_PATHS:
        assert_refused(client, acme, sessions, producer, path, body | {"prompt": ""},
                       status=400, param="prompt")


def test_long_idempotency_key_is_400_naming_the_header(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer,
) -> None:
    """Over 200 characters: a 400 that says which header and what is wrong with it."""
    for path, body in CHAT_PATHS + TEXT_PATHS[1:]:
        error = assert_refused(client, acme, sessions, producer, path, body, status=400,
                               param="Idempotency-Key", headers={"Idempotency-Key": "k" * 201})
        assert error["message"].startswith("Invalid 'Idempotency-Key' header")
        assert "200" in error["message"]
    ok = send_json(client, "/v1/jobs", CHAT, acme.headers | {"Idempotency-Key": "k" * 200})
    assert ok.status_code == 202, ok.text


def test_valid_non_ascii_text_is_accepted_and_stored_as_sent(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer,
) -> None:
    """Astral characters sent as escaped surrogate pairs are valid text, not refused."""
    body = CHAT | {"messages": [{"role": "user", "content": "caf\u00e9 \U0001f642 \u65e5"}],
                   "metadata": {"k\u00e9": "\U0001f642"}}
    response = send_json(client, "/v1/jobs", body, acme.headers)
    assert response.status_code == 202, response.text
    [(_, _, value)] = producer.records
    assert value is not None
    assert JobMessage.decode(value).body["messages"][0]["content"] == "caf\u00e9 \U0001f642 \u65e5"
    assert response.json()["metadata"] == {"k\u00e9": "\U0001f642"}


def test_hashes_never_fail_on_text_that_slipped_through() -> None:
    """request_hash and the affinity key take any str; valid text hashes as before."""
    request = JobCreate.model_validate(CHAT | {"response_format": {"type": "text", "x": LONE}})
    assert len(request_hash(request)) == 64
    assert prompt_affinity_key({"prompt": LONE}, MODEL) != prompt_affinity_key({"prompt": "x"},
                                                                                MODEL)
    assert prompt_affinity_key({"messages": [{"role": "user", "content": LONE}]}, MODEL)
    message = JobMessage(job_id="j", tenant_id="t", priority="normal", model=MODEL,
                         kind="text_completion", body={"prompt": LONE}, cache_key=LONE)
    assert message.affinity_key()
    with pytest.raises(ValueError, match="job j cannot be encoded"):
        message.encode()


@pytest.mark.parametrize(("patch", "param"), [
    ({"input": LONE}, "input"),
    ({"input": ["ok", LONE]}, "input"),
    ({"input": "x", "metadata": {"k": LONE}}, "metadata.k"),
    ({"input": "x", "cache_key": "a\x00b"}, "cache_key"),
])
def test_embedding_bodies_are_checked_alike(
    make_client: ClientFactory, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, patch: dict[str, Any], param: str,
) -> None:
    """Inputs to embed, by POST /v1/jobs and POST /v1/embeddings: a 400, never a 500."""
    client = make_client(served_models=[MODEL, "emb"], embedding_models=["emb"])
    for path in ("/v1/jobs", "/v1/embeddings"):
        assert_refused(client, acme, sessions, producer, path, {"model": "emb"} | patch,
                       status=400, param=param)


@pytest.mark.parametrize("wait", ["nan", "inf", "-1"])
def test_long_poll_wait_must_be_a_finite_number_of_seconds(
    client: TestClient, acme: TenantKey, wait: str,
) -> None:
    """`?wait=nan` is named as not finite, not as "should be >= 0"."""
    job = send_json(client, "/v1/jobs", CHAT, acme.headers).json()
    response = client.get(f"/v1/jobs/{job['id']}?wait={wait}", headers=acme.headers)
    assert response.status_code == 400, response.text
    error = assert_error_shape(response.json())
    assert error["param"] == "wait"
    if wait != "-1":
        assert "finite number" in error["message"]
