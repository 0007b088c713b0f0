"""GET /v1/models: every served model with its kind, context length and weights revision."""

from __future__ import annotations

import redis
from fastapi.testclient import TestClient

from storage.model_cards import publish_card
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.utils.api import RecordingProducer, TenantKey


def _publish(client: TestClient, name: str, **card: object) -> None:
    settings = client.app.state.resources.settings  # type: ignore[attr-defined]
    with redis.Redis.from_url(settings.redis_url) as r:
        publish_card(r, prefix=settings.topic_prefix, name=name, card={"name": name, **card})


def test_models_carry_kind_context_and_revision(make_client: ClientFactory,
                                                acme: TenantKey) -> None:
    """Kinds come from settings; context and revision from the card a worker announced."""
    client = make_client(served_models=[MODEL, "emb"], embedding_models=["emb"])
    _publish(client, "emb", kind="embedding", context_length=256, revision="0123abcd0123abcd",
             path="/m/mini")
    listing = client.get("/v1/models", headers=acme.headers).json()
    by_id = {m["id"]: m for m in listing["data"]}
    assert list(by_id) == [MODEL, "emb"]
    assert (by_id["emb"]["kind"], by_id["emb"]["context_length"], by_id["emb"]["revision"]) == (
        "embedding", 256, "0123abcd0123abcd")
    # No worker of MODEL has started yet: known kind, details still unknown.
    assert (by_id[MODEL]["kind"], by_id[MODEL]["context_length"], by_id[MODEL]["revision"]) == (
        "chat", None, None)
    one = client.get("/v1/models/emb", headers=acme.headers).json()
    assert one["revision"] == "0123abcd0123abcd"


def test_a_model_named_with_slashes_is_found(make_client: ClientFactory,
                                            acme: TenantKey) -> None:
    """Served names and model paths hold slashes, as vLLM's do; the SDK's retrieve works."""
    client = make_client(served_models=["Qwen/Qwen2.5-0.5B", "/models/tiny"])
    for name in ("Qwen/Qwen2.5-0.5B", "/models/tiny"):
        one = client.get(f"/v1/models/{name}", headers=acme.headers)
        assert one.status_code == 200 and one.json()["id"] == name, one.text
    assert client.get("/v1/models/Qwen/other", headers=acme.headers).status_code == 404


def test_jobs_go_to_their_models_topic_and_unserved_ones_nowhere(
        make_client: ClientFactory, acme: TenantKey, producer: RecordingProducer) -> None:
    """A served model's job is produced to its own topic; another is 404 naming `model`."""
    client = make_client(served_models=[MODEL, "other"])
    settings = client.app.state.resources.settings  # type: ignore[attr-defined]
    response = client.post("/v1/jobs", headers=acme.headers,
                           json={"model": "other", "prompt": "hi"})
    assert response.status_code == 202
    assert [topic for topic, _, _ in producer.records] == [
        settings.job_topics_for("other")["normal"]]
    refused = client.post("/v1/jobs", headers=acme.headers,
                          json={"model": "elsewhere", "prompt": "hi"})
    assert refused.status_code == 404
    assert refused.json()["error"]["param"] == "model"
    assert len(producer.records) == 1
