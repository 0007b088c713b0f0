"""A prompt's own log-probabilities (`prompt_logprobs`, what `echo` with `logprobs` shows):
each prompt token given the ones before it, held to Hugging Face's forward pass, whole or
in chunks, and never read from the prefix cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.unit.engine.test_engine import make_engine
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import RequestOutput, SamplingParams

PROMPTS = [[5 + (i * 7 + j * 3) % 250 for j in range(n)] for i, n in enumerate((37, 9, 2))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-prompt-logprobs")
    save_tiny_llama(path, seed=3)
    return path


def hf_prompt_logprobs(model_dir: Path, prompt: list[int], k: int
                       ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[:-1]
    chosen = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    top = logprobs.topk(k, dim=-1) if k else None
    tops = ([list(zip(i, v, strict=True)) for i, v in zip(top.indices.tolist(),
                                                         top.values.tolist(), strict=True)]
            if top is not None else [[] for _ in chosen])
    return chosen, tops


def finished(engine: Any) -> dict[str, RequestOutput]:
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return done


@pytest.mark.parametrize("budget", [None, 8])  # whole prompts, or chunks of at most 8 tokens
def test_prompt_logprobs_match_hugging_face(model_dir: Path, budget: int | None) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=budget) if budget else \
        make_engine(model_dir)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=2, temperature=0,
                                                           prompt_logprobs=i % 3))
    engine.add_request("plain", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0))
    done = finished(engine)
    assert done["plain"].prompt_logprobs is None
    for i, prompt in enumerate(PROMPTS):
        out = done[f"r{i}"]
        chosen, tops = hf_prompt_logprobs(model_dir, prompt, i % 3)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[1:] == pytest.approx(chosen, abs=1e-4)
        if i % 3:
            assert out.prompt_top_logprobs is not None
            for mine, theirs in zip(out.prompt_top_logprobs[1:], tops, strict=True):
                assert mine is not None
                assert [t for t, _ in mine] == [t for t, _ in theirs]
                assert [v for _, v in mine] == pytest.approx([v for _, v in theirs], abs=1e-4)
        else:
            assert out.prompt_top_logprobs is None


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(model_dir: Path) -> None:
    """The same prompt twice, the first leaving its blocks in the prefix cache: the second,
    asking for prompt logprobs, computes every position and gets the same figures."""
    engine = make_engine(model_dir)
    prompt = PROMPTS[0] * 2
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1, temperature=0))
    finished(engine)
    engine.add_request("again", prompt, SamplingParams(max_tokens=1, temperature=0,
                                                       prompt_logprobs=0))
    out = finished(engine)["again"]
    assert out.num_cached_tokens == 0
    chosen, _ = hf_prompt_logprobs(model_dir, prompt, 0)
    assert out.prompt_logprobs is not None
    assert out.prompt_logprobs[1:] == pytest.approx(chosen, abs=1e-4)
