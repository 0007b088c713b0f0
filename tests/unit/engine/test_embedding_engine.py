"""The embedding engine behind the engine loop, and embedding jobs' bodies and results."""

from __future__ import annotations

from concurrent.futures import Future

import orjson
import pytest
import torch

from workers.engine import SamplingParams
from workers.engine.embedding_engine import (
    EmbeddingEngine,
    EmbeddingParams,
    EmbeddingRequestOutput,
)
from workers.engine.embedding_runner import EmbeddingInput, EmbeddingRunner, EncodedInput
from workers.inference.embedding_jobs import (
    build_embedding_result,
    decode_base64_embedding,
    embedding_request_from_body,
    float32_values,
)

LONG = "many words here " * 200


def test_float_embeddings_carry_the_shortest_digits_of_each_float32() -> None:
    """Written with float32's digits, not float64's, and read back bit for bit."""
    values = torch.randn(4096, generator=torch.Generator().manual_seed(0)).numpy()
    values[:6] = [0.1, -0.0, 1e-40, 3.4e38, 1.0, -2.5e-8]  # decimal, zero, subnormal, huge
    floats = float32_values(values)
    assert floats[:2] == [0.1, -0.0] and all(type(v) is float for v in floats)
    assert torch.equal(torch.tensor(floats, dtype=torch.float32), torch.from_numpy(values))
    assert len(orjson.dumps(floats)) < 0.65 * len(orjson.dumps(values.tolist()))


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    """all-MiniLM-L6-v2 on the CPU behind the engine surface, batches on two streams."""
    return EmbeddingEngine(EmbeddingRunner("all-minilm-l6-v2", device="cpu", streams=2))


def run_all(engine: EmbeddingEngine) -> list[EmbeddingRequestOutput]:
    """Step until nothing is left; every output, in the order they finished."""
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def test_requests_share_batches_and_come_back_whole(engine: EmbeddingEngine) -> None:
    """Several requests' inputs share batches, each request gets its own vectors back."""
    engine.add_request("a", ["first text", "second"], EmbeddingParams(), priority=2)
    engine.add_request("b", ["only text", LONG], EmbeddingParams(), priority=0)
    engine.add_request("gone", ["aborted"], EmbeddingParams())
    engine.abort("gone")
    assert engine.has_unfinished_requests()
    outputs = {o.request_id: o for o in run_all(engine)}
    assert set(outputs) == {"a", "b"} and all(o.finished for o in outputs.values())
    alone = engine.runner.embed(["first text", "second", "only text", LONG])
    got = outputs["a"].embeddings + outputs["b"].embeddings
    for mine, ref in zip(got, alone, strict=True):
        torch.testing.assert_close(mine, ref.embedding, atol=1e-5, rtol=0)
    assert outputs["b"].truncated_indices == [1]
    assert outputs["b"].num_prompt_tokens == alone[2].num_tokens + 256
    assert engine.stats().num_computed_tokens >= outputs["b"].num_prompt_tokens


def test_a_lone_request_runs_on_both_streams(
    engine: EmbeddingEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Less than a full batch per stream is shared out, so both streams start at once."""
    submitted: list[int] = []
    submit = engine.runner.submit

    def counted(batch: list[EncodedInput]) -> Future[torch.Tensor]:
        submitted.append(sum(len(row.token_ids) for row in batch))
        return submit(batch)

    monkeypatch.setattr(engine.runner, "submit", counted)
    inputs: list[EmbeddingInput] = [f"sentence {i} " + "word " * 30 for i in range(60)]
    engine.add_request("lone", inputs, EmbeddingParams())
    (output,) = run_all(engine)
    num_tokens = output.num_prompt_tokens
    assert num_tokens < engine.runner.max_num_batched_tokens  # one batch before
    assert len(submitted) >= 2 and sum(submitted) == num_tokens
    assert max(submitted[:2]) <= -(-num_tokens // 2)
    for mine, ref in zip(output.embeddings, engine.runner.embed(inputs), strict=True):
        torch.testing.assert_close(mine, ref.embedding, atol=1e-5, rtol=0)


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
    (output,) = run_all(engine)
    body = {"input": "one text", "encoding_format": "base64"}
    result = build_embedding_result(output, model="emb", body=body)
    assert result["object"] == "list" and result["model"] == "emb"
    assert result["usage"] == {"prompt_tokens": output.num_prompt_tokens,
                               "total_tokens": output.num_prompt_tokens, "truncated_inputs": []}
    decoded = torch.tensor(decode_base64_embedding(result["data"][0]["embedding"]))
    torch.testing.assert_close(decoded, output.embeddings[0], atol=0, rtol=0)
    floats = build_embedding_result(output, model="emb", body={"input": "one text"})
    torch.testing.assert_close(torch.tensor(floats["data"][0]["embedding"]),
                               output.embeddings[0], atol=0, rtol=0)
    cases: list[tuple[dict[str, object], str]] = [
        ({"input": ""}, "input"), ({"input": "x", "dimensions": 10}, "dimensions"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format")]
    for bad, field in cases:
        with pytest.raises(ValueError, match=field):
            embedding_request_from_body(bad, engine)
    with pytest.raises(ValueError, match="not embeddings"):
        embedding_request_from_body({"input": "x"}, object())


@pytest.fixture(scope="module")
def small_batches() -> EmbeddingEngine:
    """Batches of at most 8 rows, so a few dozen requests make many batches."""
    return EmbeddingEngine(EmbeddingRunner("all-minilm-l6-v2", device="cpu", streams=2,
                                           max_batch_size=8))


def texts(n: int, tag: str) -> list[EmbeddingInput]:
    return [f"{tag} text number {i} " + "word " * (i % 7) for i in range(n)]


def test_steps_return_as_batches_complete_and_keep_the_streams_fed(
    small_batches: EmbeddingEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step returns what one batch finished while the next batches run; vectors are
    the runner's own for every request, however the steps cut them."""
    engine = small_batches
    submitted: list[int] = []
    submit = engine.runner.submit

    def counted(batch: list[EncodedInput]) -> Future[torch.Tensor]:
        submitted.append(len(batch))
        return submit(batch)

    monkeypatch.setattr(engine.runner, "submit", counted)
    inputs = texts(40, "flow")  # 5 batches of 8
    for i, text in enumerate(inputs):
        engine.add_request(f"r{i}", [text], EmbeddingParams())
    first = engine.step()
    assert 0 < len(first) < len(inputs) and engine.has_unfinished_requests()
    # streams + 1 batches went first; what completed was replaced before the step returned.
    assert len(submitted) > engine.runner.streams + 1
    outputs = {o.request_id: o for o in first + run_all(engine)}
    assert set(outputs) == {f"r{i}" for i in range(len(inputs))}
    alone = engine.runner.embed(inputs)
    for i, ref in enumerate(alone):
        torch.testing.assert_close(outputs[f"r{i}"].embeddings[0], ref.embedding,
                                   atol=1e-5, rtol=0)
        assert outputs[f"r{i}"].metrics.first_scheduled_time is not None


def test_an_urgent_request_goes_ahead_of_a_waiting_backlog(
    small_batches: EmbeddingEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of a waiting bulk backlog, only the batches already submitted (streams + 1) go
    before an urgent request: the next batch submitted holds it."""
    engine = small_batches
    submitted: list[list[list[int]]] = []
    submit = engine.runner.submit

    def recorded(batch: list[EncodedInput]) -> Future[torch.Tensor]:
        submitted.append([row.token_ids for row in batch])
        return submit(batch)

    monkeypatch.setattr(engine.runner, "submit", recorded)
    for i, text in enumerate(texts(64, "bulk")):
        engine.add_request(f"bulk{i}", [text], EmbeddingParams(), priority=5)
    engine.step()  # the first bulk batches run, the rest of the backlog waits
    urgent_text = "answer me first"
    engine.add_request("urgent", [urgent_text], EmbeddingParams(), priority=0)
    (urgent_ids,) = engine.runner.encode([urgent_text])
    already = len(submitted)
    outputs = run_all(engine)
    assert len(submitted) > already + 1 and "urgent" in {o.request_id for o in outputs}
    assert urgent_ids.token_ids in submitted[already]
    assert all(urgent_ids.token_ids not in batch for batch in submitted[:already])


def test_aborting_a_running_request_drops_its_rows(small_batches: EmbeddingEngine) -> None:
    """A request aborted while its batch runs never comes back; the others do, whole."""
    engine = small_batches
    # Oldest first, so its rows anchor the first batches; 40 rows cannot all finish in
    # the first step (it collects at most the streams + 1 batches of 8 first submitted).
    engine.add_request("dropped", texts(40, "dropped"), EmbeddingParams())
    engine.add_request("kept", texts(20, "kept"), EmbeddingParams())
    outputs = engine.step()
    assert "dropped" not in {o.request_id for o in outputs}
    engine.abort("dropped")
    outputs += run_all(engine)
    assert [o.request_id for o in outputs] == ["kept"]
    assert len(outputs[0].embeddings) == 20 and not engine.has_unfinished_requests()
