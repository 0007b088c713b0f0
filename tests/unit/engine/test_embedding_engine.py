"""The embedding engine behind the engine loop, and embedding jobs' bodies and results."""

from __future__ import annotations

import pytest
import torch

from workers.engine import SamplingParams
from workers.engine.embedding_engine import EmbeddingEngine, EmbeddingParams
from workers.engine.embedding_runner import EmbeddingRunner
from workers.inference.embedding_jobs import (
    build_embedding_result,
    decode_base64_embedding,
    embedding_request_from_body,
)

LONG = "many words here " * 200


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    """all-MiniLM-L6-v2 on the CPU behind the engine surface."""
    return EmbeddingEngine(EmbeddingRunner("all-minilm-l6-v2", device="cpu"))


def test_requests_share_a_step_and_come_back_whole(engine: EmbeddingEngine) -> None:
    """Several requests run in one step, most urgent first, each with its own vectors."""
    engine.add_request("a", ["first text", "second"], EmbeddingParams(), priority=2)
    engine.add_request("b", ["only text", LONG], EmbeddingParams(), priority=0)
    engine.add_request("gone", ["aborted"], EmbeddingParams())
    engine.abort("gone")
    assert engine.has_unfinished_requests()
    outputs = {o.request_id: o for o in engine.step()}
    assert not engine.has_unfinished_requests()
    assert set(outputs) == {"a", "b"} and all(o.finished for o in outputs.values())
    alone = engine.runner.embed(["first text", "second", "only text", LONG])
    got = outputs["a"].embeddings + outputs["b"].embeddings
    for mine, ref in zip(got, alone, strict=True):
        torch.testing.assert_close(mine, ref.embedding, atol=1e-5, rtol=0)
    assert outputs["b"].truncated_indices == [1]
    assert outputs["b"].num_prompt_tokens == alone[2].num_tokens + 256
    assert engine.stats().num_computed_tokens >= outputs["b"].num_prompt_tokens


def test_a_bad_request_is_refused_alone(engine: EmbeddingEngine) -> None:
    """ValueError at add_request (the loop fails that job only); nothing is left waiting."""
    with pytest.raises(ValueError, match=r"input\[0\] has \d+ tokens"):
        engine.add_request("x", [LONG], EmbeddingParams(truncate=False))
    # A chat job that reached an embedding worker: refused, and the engine carries on.
    with pytest.raises(ValueError, match="embedding model"):
        engine.add_request("y", [{"role": "user", "content": "hi"}], SamplingParams())  # type: ignore[arg-type, list-item]
    assert not engine.has_unfinished_requests()


def test_job_bodies_become_inputs_and_results(engine: EmbeddingEngine) -> None:
    """One string, token ids, base64 output; refusals name the field."""
    inputs, params = embedding_request_from_body(
        {"input": "one text", "encoding_format": "base64", "dimensions": 384}, engine)
    assert (inputs, params) == (["one text"], EmbeddingParams(truncate=True))
    assert embedding_request_from_body({"input": [1, 2, 3]}, engine)[0] == [[1, 2, 3]]
    engine.add_request("r", inputs, params)
    (output,) = engine.step()
    body = {"input": "one text", "encoding_format": "base64"}
    result = build_embedding_result(output, model="emb", body=body)
    assert result["object"] == "list" and result["model"] == "emb"
    assert result["usage"] == {"prompt_tokens": output.num_prompt_tokens,
                               "total_tokens": output.num_prompt_tokens, "truncated_inputs": []}
    decoded = torch.tensor(decode_base64_embedding(result["data"][0]["embedding"]))
    torch.testing.assert_close(decoded, output.embeddings[0], atol=0, rtol=0)
    floats = build_embedding_result(output, model="emb", body={"input": "one text"})
    assert floats["data"][0]["embedding"] == output.embeddings[0].tolist()
    cases: list[tuple[dict[str, object], str]] = [
        ({"input": ""}, "input"), ({"input": "x", "dimensions": 10}, "dimensions"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format")]
    for bad, field in cases:
        with pytest.raises(ValueError, match=field):
            embedding_request_from_body(bad, engine)
    with pytest.raises(ValueError, match="not embeddings"):
        embedding_request_from_body({"input": "x"}, object())
