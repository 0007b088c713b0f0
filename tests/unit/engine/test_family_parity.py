"""Greedy decoding of every served family equals Hugging Face `generate`, token for token.

Tiny random-weight models of each family (tiny_families.py), CPU fp32, on the torch path
and the C++ CPU kernels, with prefix caching, chunked prefill and preemption. Windows are
24 tokens and prompts up to 150, so windowed layers attend across many window shifts, in
decodes, in prefill chunks over a cached prefix and in whole prefills. Hugging Face runs
eager attention: it is the implementation that applies Gemma 2's soft-capping.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.engine.tiny_families import FAMILIES, family_config, save_family
from tests.unit.engine.tiny_models import hf_greedy
from workers.engine import LLM, SamplingParams, cpu_kernels
from workers.engine.models import check_supported

LENGTHS = [1, 5, 16, 23, 24, 25, 47, 64, 90, 129, 150, 150]
MAX_TOKENS = [12, 20, 3, 16]


def make_prompts() -> list[list[int]]:
    """12 prompts; every third shares a 60-token prefix, the last two are identical."""
    rng = random.Random(42)
    shared = [rng.randrange(3, 300) for _ in range(60)]
    prompts = []
    for i, length in enumerate(LENGTHS):
        tokens = [rng.randrange(3, 300) for _ in range(length)]
        if i % 3 == 1:
            tokens = (shared + tokens)[:length]
        prompts.append(tokens)
    prompts[-1] = list(prompts[-2])
    return prompts


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(name, model directory, Hugging Face greedy outputs) of one family."""
    from transformers import AutoModelForCausalLM

    name = request.param
    path = tmp_path_factory.mktemp(name)
    save_family(path, name)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    outputs = []
    for i, prompt in enumerate(make_prompts()):
        tokens, margin = hf_greedy(model, prompt, MAX_TOKENS[i % len(MAX_TOKENS)])
        assert margin > 1e-3, f"{name} prompt {i}: near-tied logits make the comparison moot"
        outputs.append(tokens)
    return name, path, outputs


CONFIGS: dict[str, dict[str, Any]] = {
    # Chunks of 40 tokens: prefills continue over cached prefixes that straddle windows.
    "cache-chunked": {"block_size": 16, "max_num_batched_tokens": 40},
    "nocache-whole": {"block_size": 16, "enable_prefix_caching": False,
                      "enable_chunked_prefill": False},
    # A pool barely above the longest request (150 + 20 positions): constant preemption.
    "preempt-cache": {"block_size": 16, "num_kv_blocks": 12, "max_num_batched_tokens": 64},
}  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_family_greedy_matches_hugging_face(family: Any, config: str, backend: str) -> None:
    """Every family, backend and schedule reproduces HF's greedy tokens exactly."""
    name, path, reference = family
    if backend == "cpu" and cpu_kernels.load() is not None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.load()}")
    options = {"max_num_batched_tokens": 256, "num_kv_blocks": 256, **CONFIGS[config]}
    llm = LLM(str(path), dtype="float32", device="cpu", attention_backend=backend,
              skip_tokenizer_init=True, **options)  # fmt: skip
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)])
        for i in range(len(LENGTHS))
    ]
    got = [out.token_ids for out in llm.generate(make_prompts(), params)]
    mismatches = [i for i, (a, b) in enumerate(zip(got, reference, strict=True)) if a != b]
    assert not mismatches, f"{name}: prompts {mismatches} differ from Hugging Face"
    stats = llm.engine.stats()
    if config.startswith("preempt"):
        assert stats.num_preemptions > 0
    if options.get("enable_prefix_caching", True):
        assert stats.num_prefix_cache_hit_tokens > 0
    assert stats.num_kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize(
    ("model_type", "overrides", "reason"),
    [
        ("gpt2", {}, "architecture 'gpt2' is not supported"),
        ("llama", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
         "rope_scaling type 'proportional'"),
        ("phi3", {"partial_rotary_factor": 0.01}, "partial_rotary_factor"),
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation 'relu'"),
        ("qwen3", {"layer_types": ["chunked_attention"] * 2}, "layer_types"),
    ],
)
def test_unservable_configs_are_refused_with_the_reason(
    model_type: str, overrides: dict[str, Any], reason: str
) -> None:
    """check_supported names what the engine cannot run, before anything loads."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, num_hidden_layers=2, **overrides)
    with pytest.raises(ValueError, match=reason):
        check_supported(config)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_tiny_family_is_supported(name: str) -> None:
    """The registry accepts each family config the parity tests build."""
    check_supported(family_config(name))


def test_long_windowed_sequences_hold_only_their_window(tmp_path: Path) -> None:
    """Every layer windowed (24 tokens, blocks of 16): a 150-token prompt decoding 40
    tokens holds at most the blocks its window spans, not its whole length."""
    save_family(tmp_path, "mistral-window")
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", attention_backend="torch",
              skip_tokenizer_init=True, block_size=16, num_kv_blocks=64,
              max_num_batched_tokens=64)  # fmt: skip
    engine = llm.engine
    engine.add_request("long", list(range(3, 153)), SamplingParams(temperature=0, max_tokens=40))
    most_held = 0
    while engine.has_unfinished_requests():
        engine.step()
        most_held = max(most_held, engine.stats().num_kv_blocks_used)
    # The window (24) plus a 64-token chunk span at most ceil((24 + 64) / 16) + 1 blocks;
    # the whole sequence would need ceil(190 / 16) = 12.
    assert most_held <= 7
    assert engine.stats().num_kv_blocks_used == 0
