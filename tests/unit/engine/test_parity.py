"""Greedy decoding equals Hugging Face `generate`, token for token, however it is scheduled.

A random-weight 2-layer GQA Llama, CPU fp32. 32 prompts of 1–300 tokens (some sharing
prefixes, some identical, lengths straddling block boundaries) with mixed max_tokens run
under block sizes 1 and 16, prefix caching on/off, chunked prefill on/off, and KV pools
small enough to force preemptions.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.unit.engine.tiny_models import hf_greedy, save_tiny_llama
from workers.engine import LLM, SamplingParams

LENGTHS = [1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 90, 100,
           127, 128, 129, 150, 177, 200, 229, 255, 256, 257, 270, 288, 299, 300, 300]  # fmt: skip
MAX_TOKENS = [1, 3, 8, 16, 24, 5, 12, 20]


def make_prompts() -> list[list[int]]:
    """32 prompts; every third shares a 100-token prefix, the last two are identical."""
    rng = random.Random(1234)
    shared = [rng.randrange(3, 300) for _ in range(100)]
    prompts = []
    for i, length in enumerate(LENGTHS):
        tokens = [rng.randrange(3, 300) for _ in range(length)]
        if i % 3 == 0:
            tokens = (shared + tokens)[:length]
        prompts.append(tokens)
    prompts[-1] = list(prompts[-2])
    return prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-weight model, saved once for the module."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    """Hugging Face greedy outputs; asserts the logits leave clear argmax margins."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    outputs = []
    for i, prompt in enumerate(make_prompts()):
        tokens, margin = hf_greedy(model, prompt, MAX_TOKENS[i % len(MAX_TOKENS)])
        assert margin > 1e-3, f"prompt {i}: near-tied logits make the comparison meaningless"
        outputs.append(tokens)
    return outputs


CONFIGS: dict[str, dict[str, Any]] = {
    "bs16-cache-chunked": {"block_size": 16, "max_num_batched_tokens": 128},
    "bs16-nocache-chunked": {"block_size": 16, "enable_prefix_caching": False,
                             "max_num_batched_tokens": 96},
    "bs16-cache-whole": {"block_size": 16, "enable_chunked_prefill": False},
    "bs16-nocache-whole": {"block_size": 16, "enable_prefix_caching": False,
                           "enable_chunked_prefill": False},
    "bs1-cache-chunked": {"block_size": 1, "max_num_batched_tokens": 160},
    "bs1-nocache-chunked": {"block_size": 1, "enable_prefix_caching": False,
                            "max_num_batched_tokens": 64},
    "bs1-cache-whole": {"block_size": 1, "enable_chunked_prefill": False},
    "bs1-nocache-whole": {"block_size": 1, "enable_prefix_caching": False,
                          "enable_chunked_prefill": False},
    # Pools barely above the longest request (300 + 24 - 1 positions): constant preemption.
    "bs16-preempt-cache": {"block_size": 16, "num_kv_blocks": 24, "max_num_batched_tokens": 128},
    "bs16-preempt-whole": {"block_size": 16, "num_kv_blocks": 22, "enable_prefix_caching": False,
                           "enable_chunked_prefill": False},
    "bs1-preempt-cache": {"block_size": 1, "num_kv_blocks": 360, "max_num_batched_tokens": 100},
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hugging_face(
    name: str, model_dir: Path, reference: list[list[int]]
) -> None:
    """Every configuration reproduces HF's greedy tokens exactly; no block is left held."""
    # Pools of 16k tokens unless the case sets one (the 1 GiB default is slow to set up).
    options = {"max_num_batched_tokens": 512, **CONFIGS[name]}
    options.setdefault("num_kv_blocks", 16384 // options["block_size"])
    llm = LLM(str(model_dir), dtype="float32", device="cpu", attention_backend="torch",
              skip_tokenizer_init=True, **options)  # fmt: skip
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)])
        for i in range(len(LENGTHS))
    ]
    outputs = llm.generate(make_prompts(), params)
    got = [out.token_ids for out in outputs]
    mismatches = [i for i, (a, b) in enumerate(zip(got, reference, strict=True)) if a != b]
    assert not mismatches, f"prompts {mismatches} differ from Hugging Face"
    stats = llm.engine.stats()
    if "preempt" in name:
        assert stats.num_preemptions > 0
    if options.get("enable_prefix_caching", True):
        assert stats.num_prefix_cache_hit_tokens > 0
    assert stats.num_kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
