"""POST /v1/embeddings and embedding jobs at the API: routing, and refusals before queueing.

The producer is a recorder, so these check what would be published, and that nothing is
for a refused request; a worker answering them is tested in tests/integration.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from core.embedding_requests import MAX_EMBEDDING_INPUTS
from storage.model_cards import publish_card
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.utils.api import RecordingProducer, TenantKey
from workers.engine.registry import resolve_model

EMB = "minilm"


@pytest.fixture
def client(make_client: ClientFactory) -> TestClient:
    """An app serving a chat model and an embedding model whose worker announced its card."""
    client = make_client(served_models=[MODEL, EMB], embedding_models=[EMB])
    settings = client.app.state.resources.settings  # type: ignore[attr-defined]
    path = resolve_model("all-minilm-l6-v2", settings.models_dir)
    card = {"name": EMB, "kind": "embedding", "context_length": 256, "dimensions": 384,
            "revision": "0" * 16, "path": str(path)}
    with redis.Redis.from_url(settings.redis_url) as r:
        publish_card(r, prefix=settings.topic_prefix, name=EMB, card=card)
    return client


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def test_an_embedding_job_goes_to_its_models_topic(
        client: TestClient, acme: TenantKey, producer: RecordingProducer) -> None:
    """POST /v1/jobs with `input` queues an `embedding` job on the embedding model's topic."""
    settings = client.app.state.resources.settings  # type: ignore[attr-defined]
    response = client.post("/v1/jobs", headers=acme.headers, json={
        "model": EMB, "input": ["a", "b"], "encoding_format": "base64", "priority": "low"})
    assert response.status_code == 202, response.text
    assert response.json()["model"] == EMB
    ((topic, _, value),) = producer.records
    assert topic == settings.job_topics_for(EMB)["low"]
    message = json.loads(value or b"{}")
    assert message["kind"] == "embedding"
    assert message["body"] == {"model": EMB, "input": ["a", "b"], "encoding_format": "base64"}


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "nope", "input": "x"}, 404, "model"),
    ({"model": MODEL, "input": "x"}, 400, "model"),  # a chat model has no embeddings
    ({"model": EMB, "input": ""}, 400, "input"),
    ({"model": EMB, "input": []}, 400, "input"),
    ({"model": EMB, "input": ["ok", ""]}, 400, "input"),
    ({"model": EMB, "input": [[1, 2], []]}, 400, "input"),
    ({"model": EMB, "input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, 400, "input"),
    ({"model": EMB, "input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"model": EMB, "input": "x", "dimensions": 128}, 400, "dimensions"),
    ({"model": EMB, "input": "word " * 300, "truncate": False}, 400, "input"),
])
def test_bad_embedding_requests_are_refused_and_nothing_is_queued(
        client: TestClient, acme: TenantKey, producer: RecordingProducer,
        body: dict[str, Any], status: int, param: str) -> None:
    """Unknown or chat model, empty input, too many, bad format or size, over-long: 4xx."""
    for path in ("/v1/embeddings", "/v1/jobs"):
        error = _error(client.post(path, headers=acme.headers, json=body), status)
        assert error["param"] == param, (path, error)
    assert producer.records == []


def test_over_long_input_is_truncated_by_default(
        client: TestClient, acme: TenantKey, producer: RecordingProducer) -> None:
    """Without truncate: false a long text is accepted (the worker cuts it and says so)."""
    response = client.post("/v1/jobs", headers=acme.headers,
                           json={"model": EMB, "input": "word " * 300})
    assert response.status_code == 202, response.text
    assert len(producer.records) == 1


def test_a_completion_body_for_an_embedding_model_is_refused(
        client: TestClient, acme: TenantKey, producer: RecordingProducer) -> None:
    """Chat or text bodies naming the embedding model: 400 naming `model`, nothing queued."""
    for path, body in (("/v1/jobs", {"model": EMB, "prompt": "hi"}),
                       ("/v1/chat/completions",
                        {"model": EMB, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"model": EMB, "prompt": "hi"})):
        error = _error(client.post(path, headers=acme.headers, json=body), 400)
        assert (error["param"], error["code"]) == ("model", "wrong_model_kind")
    assert producer.records == []


def test_a_batch_may_target_the_embeddings_endpoint(client: TestClient, acme: TenantKey) -> None:
    """POST /v1/batches takes `endpoint: /v1/embeddings` (OpenAI Batch accepts it)."""
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": EMB, "input": "hello"}})
    uploaded = client.post("/v1/files", headers=acme.headers, data={"purpose": "batch"},
                           files={"file": ("in.jsonl", line.encode() + b"\n",
                                           "application/jsonl")})
    assert uploaded.status_code == 200, uploaded.text
    batch = client.post("/v1/batches", headers=acme.headers, json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/embeddings",
        "completion_window": "24h"})
    assert batch.status_code == 200, batch.text
    assert batch.json()["endpoint"] == "/v1/embeddings"
