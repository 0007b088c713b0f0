"""Embeddings end to end: the official OpenAI client → API → Kafka → an embedding worker.

One worker process serves all-MiniLM-L6-v2 (the packaged weights) under the name `minilm`
beside a chat model name the API also serves; the vectors it returns must equal the
embedding runner's own, whichever way they travel (floats, base64, a queued job).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from core.settings import Settings
from storage.db import create_db_engine, session_factory
from storage.migrate import upgrade
from tests.utils.api import TenantKey, make_tenant_key
from tests.utils.service import WorkerProcess, running_api
from workers.engine.embedding_runner import EmbeddingRunner
from workers.engine.registry import resolve_model

NAME = "minilm"
TEXTS = ["A sentence about cats.", "Une phrase en français.", "猫についての文。"]
LONG = "long input " * 400


@pytest.fixture
def embedding_service(settings: Any, tmp_path: Path) -> Iterator[tuple[Settings, str, TenantKey]]:
    """API on a thread and one embedding worker; yields settings, base URL and a key."""
    model_dir = resolve_model("all-minilm-l6-v2", tmp_path)
    s: Settings = settings(model=str(model_dir), served_model_name=NAME,
                           served_models=["chat-model", NAME], embedding_models=[NAME],
                           topic_partitions=1, kafka_session_timeout_ms=6000,
                           models_dir=tmp_path / "models")
    upgrade(s.database_url)
    engine = create_db_engine(s.database_url)
    key = make_tenant_key(session_factory(engine), "embedders")
    worker = WorkerProcess(s, tmp_path / "worker.log")
    try:
        with running_api(s) as url:
            yield s, url, key
    finally:
        worker.stop()
        engine.dispose()


def _wait_for_card(url: str, key: TenantKey) -> dict[str, Any]:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        models = httpx.get(f"{url}/v1/models", headers=key.headers).json()["data"]
        card = {m["id"]: m for m in models}[NAME]
        if card["revision"]:
            return card
        time.sleep(1)
    raise AssertionError("the embedding worker never announced its model")


def test_embeddings_through_the_service_equal_the_runners(
        embedding_service: tuple[Settings, str, TenantKey]) -> None:
    """Floats, base64 (the OpenAI client's default), a job, truncation in usage."""
    s, url, key = embedding_service
    card = _wait_for_card(url, key)
    assert (card["kind"], card["context_length"]) == ("embedding", 256)
    runner = EmbeddingRunner(s.model, device="cpu")
    expected = [o.embedding for o in runner.embed(TEXTS)]

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key.key, timeout=300, max_retries=0)
    answer = client.embeddings.create(model=NAME, input=TEXTS)  # base64 on the wire
    assert [d.index for d in answer.data] == [0, 1, 2]
    for item, want in zip(answer.data, expected, strict=True):
        torch.testing.assert_close(torch.tensor(item.embedding), want, atol=1e-5, rtol=0)
    assert answer.usage.prompt_tokens == sum(o.num_tokens for o in runner.embed(TEXTS))

    floats = httpx.post(f"{url}/v1/embeddings", headers=key.headers, timeout=300, json={
        "model": NAME, "input": ["short", LONG], "encoding_format": "float"}).json()
    assert floats["usage"]["truncated_inputs"] == [1]
    assert len(floats["data"][1]["embedding"]) == 384

    job = httpx.post(f"{url}/v1/jobs", headers=key.headers,
                     json={"model": NAME, "input": TEXTS[0], "priority": "low"}).json()
    done = httpx.get(f"{url}/v1/jobs/{job['id']}?wait=120", headers=key.headers,
                     timeout=180).json()
    assert done["status"] == "succeeded", done
    torch.testing.assert_close(torch.tensor(done["result"]["data"][0]["embedding"]),
                               expected[0], atol=1e-5, rtol=0)

    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="chat-model", input="x")
    assert refused.value.body["param"] == "model"  # type: ignore[index]
