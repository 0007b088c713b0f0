"""`stream: true` on /v1/responses through the app: the Responses API's typed events, each
checked against the official client's event types, and the fields refused before a job
is queued. (Streams from a real worker: tests/integration/test_streaming.py.)"""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest
from fastapi.testclient import TestClient
from openai.types.responses import ResponseStreamEvent
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.responses_api import response_object
from storage.models import Job, JobStatus
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.unit.api.test_completions_api import prefix_of
from tests.utils.api import TenantKey

# The official client's event class of each type (its union does not say which failed).
TYPE_TO_EVENT = {get_args(cls.model_fields["type"].annotation)[0]: cls
                 for cls in get_args(get_args(ResponseStreamEvent)[0])}
STREAMED = {"model": MODEL, "input": "Hi", "stream": True}


def _events(client: TestClient, acme: TenantKey, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events' data, each checked: its `event:` name is its type, it parses
    as the official client's event, and sequence numbers count up from 0."""
    response = client.post("/v1/responses", json=body, headers=acme.headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in response.text  # Responses streams end with their last event
    events = []
    for block in response.text.strip().split("\n\n"):
        lines = block.split("\n")
        if lines[0].startswith(":"):
            continue  # a keep-alive
        name, data = lines[0].removeprefix("event: "), json.loads(lines[1][6:])
        assert data["type"] == name
        TYPE_TO_EVENT[name].model_validate(data)
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_a_finished_response_streams_in_openai_order(client: TestClient, acme: TenantKey,
                                                     fake_worker: Any) -> None:
    """With no token stream to read (as for a cached answer) the text comes whole from
    the stored response, between the item's opening and closing events."""
    def finish(job: Job) -> tuple[str, dict[str, Any]]:
        chat = {"created": 7, "model": MODEL, "usage": {"prompt_tokens": 3,
                "completion_tokens": 2, "total_tokens": 5},
                "choices": [{"index": 0, "finish_reason": "length",
                             "message": {"role": "assistant", "content": "Hi there"}}]}
        return "succeeded", response_object(chat, job_id=job.id, body=job.request)

    fake_worker(prefix_of(client), finish)
    events = _events(client, acme, {**STREAMED, "max_output_tokens": 2})
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    created, last = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["id"] == last["id"] and created["max_output_tokens"] == 2
    assert events[4]["delta"] == events[5]["text"] == "Hi there"
    assert last["output"][0]["content"][0]["text"] == "Hi there"
    assert last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[7]["item"] == last["output"][0]


def test_a_failed_job_ends_with_response_failed(client: TestClient, acme: TenantKey,
                                                fake_worker: Any) -> None:
    error = {"message": "the engine broke", "type": "server_error", "code": "engine_error"}
    fake_worker(prefix_of(client), lambda job: ("failed", error))
    events = _events(client, acme, STREAMED)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error",
                               "message": "the engine broke (engine_error)"}


def test_a_stream_out_of_time_ends_with_an_error_and_cancels_its_job(
    make_client: ClientFactory, acme: TenantKey, sessions: sessionmaker[Session]
) -> None:
    """No worker: after sync_request_timeout_s the stream ends with an `error` event and
    the job is cancelled."""
    events = _events(make_client(sync_request_timeout_s=0.5), acme, STREAMED)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "error"]
    assert events[-1]["code"] == "timeout"
    with sessions() as session:
        assert session.scalars(select(Job.status)).all() == [JobStatus.CANCELLED]


@pytest.mark.parametrize(("extra", "param"), [
    ({"stream": "yes"}, "stream"),
    ({"stream": True, "background": True}, "background"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"include_obfuscation": 1}},
     "stream_options.include_obfuscation"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"stream": True, "tools": [{"type": "function", "name": "f"}]}, "tools"),
])
def test_stream_fields_refused_before_anything_is_queued(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    extra: dict[str, Any], param: str
) -> None:
    response = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", **extra},
                           headers=acme.headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    with sessions() as session:
        assert session.scalars(select(Job)).all() == []


def test_a_queued_or_failed_response_reads_back_with_its_state(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session]
) -> None:
    """`background: true` answers with OpenAI's response object, `queued`, and GET
    /v1/responses/{id} reads the same before the job ran; once it failed, `failed` with
    the error; another kind of job is not a response."""
    from openai.types.responses import Response

    queued = client.post("/v1/responses", headers=acme.headers, json={
        "model": MODEL, "input": "Hi", "background": True, "metadata": {"k": "v"},
        "instructions": "Answer in French."})
    assert queued.status_code == 200, queued.text
    job_id = queued.headers["x-job-id"]
    assert queued.headers["location"] == f"/v1/jobs/{job_id}"
    answered = Response.model_validate(queued.json())
    read = client.get(f"/v1/responses/resp_{job_id}", headers=acme.headers)
    assert read.status_code == 200, read.text
    response = Response.model_validate(read.json())
    assert response == answered
    assert (response.id, response.status, response.metadata, response.instructions) == (
        f"resp_{job_id}", "queued", {"k": "v"}, "Answer in French.")
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None
        assert response.created_at == int(job.created_at.timestamp())
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.status, job.error = JobStatus.FAILED, {"message": "boom", "code": "engine_error"}
        session.commit()
    failed = client.get(f"/v1/responses/resp_{job_id}", headers=acme.headers).json()
    assert failed["status"] == "failed" and failed["error"]["message"] == "boom"
    chat = client.post("/v1/jobs", headers=acme.headers,
                       json={"model": MODEL, "prompt": "hi"}).json()["id"]
    missing = client.get(f"/v1/responses/resp_{chat}", headers=acme.headers)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"


def test_a_response_is_cancelled_once_and_then_reads_cancelled(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session]
) -> None:
    """POST /v1/responses/{id}/cancel: the response `cancelled` (again on a second call,
    as OpenAI's is idempotent); a finished one 409; another kind of job, or another
    tenant's response, 404."""
    from openai.types.responses import Response

    job_id = client.post("/v1/responses", headers=acme.headers, json={
        "model": MODEL, "input": "Hi", "background": True}).headers["x-job-id"]
    for _ in range(2):
        cancelled = client.post(f"/v1/responses/resp_{job_id}/cancel", headers=acme.headers)
        assert cancelled.status_code == 200, cancelled.text
        response = Response.model_validate(cancelled.json())
        assert (response.id, response.status, response.error) == (
            f"resp_{job_id}", "cancelled", None)
    assert client.get(f"/v1/responses/{job_id}", headers=acme.headers).json()["status"] == (
        "cancelled")
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.status is JobStatus.CANCELLED

    done_id = client.post("/v1/responses", headers=acme.headers, json={
        "model": MODEL, "input": "Hi again", "background": True}).headers["x-job-id"]
    with sessions() as session:
        job = session.get(Job, done_id)
        assert job is not None
        job.status, job.error = JobStatus.FAILED, {"message": "boom"}
        session.commit()
    refused = client.post(f"/v1/responses/resp_{done_id}/cancel", headers=acme.headers)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "response_not_cancellable"
    assert "already failed" in refused.json()["error"]["message"]

    chat = client.post("/v1/jobs", headers=acme.headers,
                       json={"model": MODEL, "prompt": "hi"}).json()["id"]
    assert client.post(f"/v1/responses/resp_{chat}/cancel",
                       headers=acme.headers).status_code == 404
    with sessions() as session:  # not cancelled: it is not a response
        job = session.get(Job, chat)
        assert job is not None and job.status is JobStatus.QUEUED


def test_input_items_list_the_input_as_sent_a_page_at_a_time(
    client: TestClient, acme: TenantKey
) -> None:
    """GET /v1/responses/{id}/input_items: the input messages (not the instructions),
    newest first by default, paged by `after`/`before` and `limit`, each an item of the
    official client's types."""
    from openai.types.responses import ResponseItem
    from pydantic import TypeAdapter

    item_type: TypeAdapter[Any] = TypeAdapter(ResponseItem)
    sent = [{"role": "user", "content": "one"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "two"}]},
            {"type": "message", "role": "developer", "content": "three"},
            {"role": "user", "content": [{"type": "input_text", "text": "four"},
                                         {"type": "input_text", "text": "five"}]}]
    job_id = client.post("/v1/responses", headers=acme.headers, json={
        "model": MODEL, "input": sent, "instructions": "Be brief.",
        "background": True}).headers["x-job-id"]
    url = f"/v1/responses/resp_{job_id}/input_items"

    whole = client.get(url, headers=acme.headers, params={"order": "asc"}).json()
    assert whole["object"] == "list" and whole["has_more"] is False
    items = [item_type.validate_python(item) for item in whole["data"]]
    assert [(i.role, i.content[0].text) for i in items] == [  # type: ignore[union-attr]
        ("user", "one"), ("assistant", "two"), ("developer", "three"),
        ("user", "four\nfive")]
    ids = [item["id"] for item in whole["data"]]
    assert len(set(ids)) == 4 and (whole["first_id"], whole["last_id"]) == (ids[0], ids[-1])

    newest = client.get(url, headers=acme.headers, params={"limit": 2}).json()
    assert [item["id"] for item in newest["data"]] == ids[::-1][:2]
    assert newest["has_more"] is True
    rest = client.get(url, headers=acme.headers,
                      params={"limit": 2, "after": newest["last_id"]}).json()
    assert [item["id"] for item in rest["data"]] == ids[::-1][2:]
    assert rest["has_more"] is False
    before = client.get(url, headers=acme.headers,
                        params={"order": "asc", "before": ids[2]}).json()
    assert [item["id"] for item in before["data"]] == ids[:2]
    just_before = client.get(url, headers=acme.headers,
                             params={"order": "asc", "before": ids[3], "limit": 2}).json()
    assert [item["id"] for item in just_before["data"]] == ids[1:3]  # the two before it
    assert just_before["has_more"] is True  # ids[0], further back

    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                          ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        refused = client.get(url, headers=acme.headers, params=params)
        assert refused.status_code == 400, (params, refused.text)
        assert refused.json()["error"]["param"] == param
    assert client.get("/v1/responses/resp_nope/input_items",
                      headers=acme.headers).status_code == 404


@pytest.mark.parametrize(("body", "param"), [
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"stream": True, "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"background": True, "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_refusals_name_the_fields_a_responses_body_has(
        client: TestClient, acme: TenantKey, body: dict[str, Any], param: str) -> None:
    """The chat checks the body runs through name chat's fields; the client sent these."""
    response = client.post("/v1/responses", json={"model": MODEL, "input": "hi", **body},
                           headers=acme.headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert "max_completion_tokens" not in error["message"]
    assert "response_format" not in error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"background": "yes"}, "background"),
    ({"stream": 1}, "stream"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": "no"}},
     "stream_options.include_obfuscation"),
])
def test_the_routes_own_fields_are_refused_with_a_code(
        client: TestClient, acme: TenantKey, body: dict[str, Any], param: str) -> None:
    response = client.post("/v1/responses", json={"model": MODEL, "input": "hi", **body},
                           headers=acme.headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert response.json()["error"]["code"] == "invalid_value"


def test_background_needs_store_and_a_stored_response_is_not_streamed_again(
        client: TestClient, acme: TenantKey) -> None:
    """`store: false` with `background` is refused, as OpenAI refuses it; a retrieve asking
    for a stream is refused rather than answered as JSON (a client would read no events)."""
    refused = client.post("/v1/responses", headers=acme.headers, json={
        "model": MODEL, "input": "Hi", "background": True, "store": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"
    job_id = client.post("/v1/responses", headers=acme.headers, json={
        "model": MODEL, "input": "Hi", "background": True}).headers["x-job-id"]
    refusals: list[tuple[dict[str, str | int], str]] = [
        ({"stream": "true"}, "stream"), ({"stream": "true", "starting_after": 3}, "stream"),
        ({"starting_after": 3}, "starting_after")]
    for params, param in refusals:
        streamed = client.get(f"/v1/responses/resp_{job_id}", headers=acme.headers,
                              params=params)
        assert streamed.status_code == 400, streamed.text
        assert streamed.json()["error"]["param"] == param
    assert client.get(f"/v1/responses/resp_{job_id}", headers=acme.headers,
                      params={"stream": "false"}).status_code == 200
