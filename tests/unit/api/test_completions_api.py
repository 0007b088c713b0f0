"""OpenAI-compatible completions: enqueued high, awaited, answered with the stored object."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from storage.models import Job, JobStatus
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.utils.api import CHAT_BODY, TenantKey


def result_for(job: Job) -> dict[str, Any]:
    """An OpenAI-shaped result of the job's kind, as a worker would store it."""
    if job.kind == "chat.completion":
        return {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": 1,
                "model": job.model, "system_fingerprint": None,
                "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                             "message": {"role": "assistant", "content": "Hi there"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": 1,
            "model": job.model,
            "choices": [{"index": 0, "text": " upon a time", "finish_reason": "length",
                         "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}}


def prefix_of(client: TestClient) -> str:
    """The app's topic prefix (names its Redis channels)."""
    return str(client.app.state.resources.settings.topic_prefix)  # type: ignore[attr-defined]


def test_chat_completion_returns_the_stored_object(
    client: TestClient, acme: TenantKey, fake_worker: Any, sessions: sessionmaker[Session]
) -> None:
    """The answer is byte-for-byte the worker's chat.completion; the job ran as high."""
    fake_worker(prefix_of(client), lambda job: ("succeeded", result_for(job)))
    response = client.post("/v1/chat/completions", json={"model": MODEL, **CHAT_BODY},
                           headers=acme.headers)
    assert response.status_code == 200
    job_id = response.headers["X-Job-Id"]
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.priority == "high"
        assert response.json() == job.result


def test_text_completion_returns_the_stored_object(
    client: TestClient, acme: TenantKey, fake_worker: Any
) -> None:
    """/v1/completions answers with a text_completion."""
    fake_worker(prefix_of(client), lambda job: ("succeeded", result_for(job)))
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once",
                                                    "max_tokens": 4}, headers=acme.headers)
    assert response.status_code == 200
    assert response.json()["object"] == "text_completion"
    assert response.json()["choices"][0]["text"] == " upon a time"


def test_failed_job_maps_to_an_error_response(
    client: TestClient, acme: TenantKey, fake_worker: Any
) -> None:
    """A job the worker refused as invalid is a 400 carrying the worker's message."""
    error = {"message": "prompt is longer than the model's context", "type":
             "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}
    fake_worker(prefix_of(client), lambda job: ("failed", error))
    response = client.post("/v1/chat/completions", json={"model": MODEL, **CHAT_BODY},
                           headers=acme.headers)
    assert response.status_code == 400
    assert response.json() == {"error": error}


def test_slow_job_times_out_with_504_and_is_cancelled(
    make_client: ClientFactory, acme: TenantKey, sessions: sessionmaker[Session]
) -> None:
    """No worker: after sync_request_timeout_s the request gets 504 and the job is cancelled."""
    client = make_client(sync_request_timeout_s=0.5)
    response = client.post("/v1/chat/completions", json={"model": MODEL, **CHAT_BODY},
                           headers=acme.headers)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    with sessions() as session:
        statuses = session.scalars(select(Job.status)).all()
    assert statuses == [JobStatus.CANCELLED]


def test_service_tier_picks_the_queue_priority_where_no_priority_is_sent(
    client: TestClient, acme: TenantKey, fake_worker: Any, sessions: sessionmaker[Session]
) -> None:
    """OpenAI's `service_tier`: `priority` runs high, `flex` low, the others leave the
    endpoint's default (high for a waiting client, normal for a job); a request's own
    `priority` wins, and sent with a tier that would move it, is refused."""
    fake_worker(prefix_of(client), lambda job: ("succeeded", result_for(job)))
    chat = {"model": MODEL, **CHAT_BODY}
    text = {"model": MODEL, "prompt": "Once", "max_tokens": 4}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", chat | {"service_tier": "flex"}, "low"),
        ("/v1/chat/completions", chat | {"service_tier": "priority"}, "high"),
        ("/v1/chat/completions", chat | {"service_tier": "default"}, "high"),
        ("/v1/chat/completions", chat | {"service_tier": "auto", "priority": 1}, "normal"),
        # A client library's null for a field left unset is not a priority.
        ("/v1/chat/completions", chat | {"service_tier": "flex", "priority": None}, "low"),
        ("/v1/completions", text | {"service_tier": "flex", "stream": True}, "low"),
        ("/v1/completions", text | {"priority": 2, "stream": True}, "low"),
        ("/v1/jobs", chat | {"service_tier": "flex"}, "low"),
        ("/v1/jobs", chat | {"service_tier": "scale"}, "normal"),
        ("/v1/jobs", chat | {"service_tier": "auto", "priority": "high"}, "high"),
    ]
    for path, body, priority in cases:
        response = client.post(path, json=body, headers=acme.headers)
        assert response.status_code in (200, 202), (path, body, response.text)
        job_id = response.headers.get("X-Job-Id") or response.json()["id"]
        with sessions() as session:
            job = session.get(Job, job_id)
            assert job is not None and job.priority == priority, (path, body)
    for path, body in (("/v1/chat/completions", chat | {"service_tier": "flex", "priority": 0}),
                       ("/v1/jobs", chat | {"service_tier": "priority", "priority": "low"}),
                       ("/v1/chat/completions", chat | {"service_tier": "slow"})):
        response = client.post(path, json=body, headers=acme.headers)
        assert response.status_code == 400, (path, body)
        assert response.json()["error"]["param"] == "service_tier"
