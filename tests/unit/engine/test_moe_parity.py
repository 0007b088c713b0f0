"""Mixtures of experts decode greedily as Hugging Face does, token for token (fp32).

Tiny random-weight Mixtral (also with a sliding window), Qwen2-MoE (a shared expert, a
dense layer among sparse ones, unnormalised routing; and one without q/k/v biases) and
Qwen3-MoE models, built here: prompts of 1-200 tokens, some sharing a prefix, under prefix
caching with chunked prefill, and a pool small enough to force preemptions; on the torch
attention path and on the default CPU backend.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.unit.engine.tiny_models import hf_greedy, save_tokenizer
from workers.engine import LLM, SamplingParams

COMMON: dict[str, Any] = {
    "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "initializer_range": 0.5,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "tie_word_embeddings": False,
}  # fmt: skip
FAMILIES: dict[str, tuple[type[PretrainedConfig], Any, dict[str, Any]]] = {
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                {"intermediate_size": 96, "num_local_experts": 6, "num_experts_per_tok": 2}),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                  {"intermediate_size": 128, "moe_intermediate_size": 48, "num_experts": 8,
                   "num_experts_per_tok": 3, "shared_expert_intermediate_size": 80,
                   "norm_topk_prob": False, "mlp_only_layers": [1]}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  {"intermediate_size": 128, "moe_intermediate_size": 40, "num_experts": 8,
                   "num_experts_per_tok": 2, "norm_topk_prob": True, "head_dim": 32}),
    # Qwen2-MoE's config can drop the q/k/v biases; renormalised routing.
    "qwen2_moe-no-qkv-bias": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                              {"intermediate_size": 128, "moe_intermediate_size": 48,
                               "num_experts": 4, "num_experts_per_tok": 2,
                               "shared_expert_intermediate_size": 64, "norm_topk_prob": True,
                               "qkv_bias": False}),
    # Every layer windowed: keys further back than 24 positions are never read.
    "mixtral-window": (MixtralConfig, MixtralForCausalLM,
                       {"intermediate_size": 96, "num_local_experts": 4,
                        "num_experts_per_tok": 2, "sliding_window": 24}),
}  # fmt: skip
LENGTHS = [1, 3, 16, 17, 40, 64, 100, 150, 200, 200]
MAX_TOKENS = [8, 12, 5, 16]


def make_prompts() -> list[list[int]]:
    """Ten prompts; every other one shares a 60-token prefix, the last two are equal."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 300) for _ in range(60)]
    prompts = []
    for i, length in enumerate(LENGTHS):
        tokens = [rng.randrange(3, 300) for _ in range(length)]
        prompts.append((shared + tokens)[:length] if i % 2 else tokens)
    prompts[-1] = list(prompts[-2])
    return prompts


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, list[list[int]]]:
    """A saved random-weight model of the family and Hugging Face's greedy outputs."""
    config_class, model_class, extra = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = model_class(config_class(**COMMON, **extra)).eval()
    model.save_pretrained(path)
    save_tokenizer(path)
    reference = []
    for i, prompt in enumerate(make_prompts()):
        tokens, margin = hf_greedy(model, prompt, MAX_TOKENS[i % len(MAX_TOKENS)])
        assert margin > 1e-3, f"prompt {i}: near-tied logits make the comparison meaningless"
        reference.append(tokens)
    return path, reference


@pytest.mark.parametrize(("backend", "options"), [
    ("torch", {"block_size": 16, "max_num_batched_tokens": 64}),
    ("torch", {"block_size": 16, "num_kv_blocks": 16, "max_num_batched_tokens": 96}),
    ("auto", {"block_size": 16, "max_num_batched_tokens": 128}),
])  # fmt: skip
def test_greedy_matches_hugging_face(
    family: tuple[Path, list[list[int]]], backend: str, options: dict[str, Any]
) -> None:
    """Chunked prefill, prefix hits and (with 16 blocks) preemption; nothing left held."""
    path, reference = family
    options = {"num_kv_blocks": 1024, **options}
    llm = LLM(str(path), dtype="float32", device="cpu", attention_backend=backend,
              skip_tokenizer_init=True, **options)  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)])
              for i in range(len(LENGTHS))]
    got = [out.token_ids for out in llm.generate(make_prompts(), params)]
    mismatches = [i for i, (a, b) in enumerate(zip(got, reference, strict=True)) if a != b]
    assert not mismatches, f"prompts {mismatches} differ from Hugging Face"
    stats = llm.engine.stats()
    assert stats.num_prefix_cache_hit_tokens > 0
    if options["num_kv_blocks"] == 16:
        assert stats.num_preemptions > 0
    assert stats.num_kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
