"""An fp8 (e4m3) KV cache: four times the fp32 pool's blocks in the same bytes, the
engine through it, both CPU attention paths reading it alike, and what it refuses."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.unit.engine.checkpoints import make_seq, place
from tests.unit.engine.test_engine import engine_options, greedy, make_engine, random_prompt
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine.config import EngineConfig
from workers.engine.kv_dtypes import FP8_KV
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-fp8-kv")
    save_tiny_llama(path, seed=3)
    return path


def _sized(model_dir: Path, budget: int, **options: object) -> LLMEngine:
    config = engine_options(kv_cache_memory_bytes=budget, **options)
    del config["num_kv_blocks"]
    return LLMEngine(EngineConfig(model=str(model_dir), **config))


def test_an_fp8_pool_holds_four_times_the_blocks_of_an_fp32_one(model_dir: Path) -> None:
    budget = 8 << 20
    full = _sized(model_dir, budget).runner
    fp8 = _sized(model_dir, budget, kv_cache_dtype="fp8").runner
    assert full.kv_cache.dtype == torch.float32 and fp8.kv_cache.dtype == FP8_KV
    assert fp8.num_kv_blocks == 4 * full.num_kv_blocks
    assert fp8.kv_cache.nbytes == pytest.approx(full.kv_cache.nbytes, rel=0.01)
    assert full.backend.name == fp8.backend.name  # the C++ kernels read both


def test_the_engine_generates_through_an_fp8_pool(model_dir: Path) -> None:
    """Prompts prefilled in chunks (later chunks attend the earlier ones' fp8 K/V), then
    decodes over the fp8 pool, to the end of every request."""
    rng = random.Random(4)
    engine = make_engine(model_dir, kv_cache_dtype="fp8",
                         max_num_batched_tokens=48)  # prompts split into chunks
    for i, n in enumerate((5, 17, 40, 64, 70, 90, 33, 100)):
        engine.add_request(f"r{i}", random_prompt(rng, n), greedy(12))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    assert len(done) == 8 and all(len(ids) == 12 for ids in done.values())
    assert engine.runner.kv_cache.dtype == FP8_KV
    assert engine.runner.kv_cache.view(torch.uint8).any()  # it holds something


def pool_logits(model_dir: Path, prompts: list[list[int]], *, kv_cache_dtype: str,
                backend: str = "cpu") -> torch.Tensor:
    """Every position's logits with the prompts fed a token a step, so that attention reads
    every key from the pool (none from the step's own fresh rows)."""
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", device="cpu",
                                      kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64,
                                      attention_backend=backend))
    assert runner.backend.name == backend
    seqs = [make_seq(p[:1], f"s{i}") for i, p in enumerate(prompts)]
    place(seqs, [len(p) for p in prompts], runner.block_size)
    steps = []
    for pos in range(max(len(p) for p in prompts)):
        live = [s for s, p in zip(seqs, prompts, strict=True) if pos < len(p)]
        _, step_logits = runner.compute_logits(live, [1] * len(live))
        steps.append(step_logits)
        for seq, prompt in zip(seqs, prompts, strict=True):
            if pos + 1 < len(prompt):
                seq.num_computed_tokens = pos + 1
                seq.append_token(prompt[pos + 1])
    return torch.cat(steps)


def test_decode_logits_over_an_fp8_pool_equal_the_torch_paths(model_dir: Path) -> None:
    """The C++ kernel and the torch path read the same e4m3 bytes back: their logits agree
    to float32 rounding at every position. (Against a full-precision pool they differ by
    far more: the tiny model's attention scores are large, and e4m3 keeps 3 bits of each
    mantissa.)"""
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (5, 17, 40)]
    logits = {(dtype, backend): pool_logits(model_dir, prompts, kv_cache_dtype=dtype,
                                            backend=backend)
              for dtype, backend in (("fp8", "cpu"), ("fp8", "torch"), ("auto", "cpu"))}
    torch.testing.assert_close(logits["fp8", "cpu"], logits["fp8", "torch"], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits["fp8", "cpu"], logits["auto", "cpu"], atol=1e-2)


def test_kv_cache_dtypes_that_cannot_run_are_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        EngineConfig(model=str(model_dir), kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="fp8 KV cache for float32 and bfloat16"):
        make_engine(model_dir, dtype="float16", kv_cache_dtype="fp8", attention_backend="cpu")
