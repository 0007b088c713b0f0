"""An fp8 (e4m3) KV cache: four times the fp32 pool's blocks in the same bytes, the
engine's outputs through it, and the choices it refuses."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.unit.engine.test_engine import engine_options, greedy, make_engine, random_prompt
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine.config import EngineConfig
from workers.engine.kv_dtypes import FP8_KV
from workers.engine.llm_engine import LLMEngine


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
    # The C++ kernel reads the model's dtype only: an fp8 pool is read by torch attention.
    assert (full.backend.name, fp8.backend.name) == ("cpu", "torch")


def test_the_engine_generates_through_an_fp8_pool(model_dir: Path) -> None:
    """Prompts prefilled in chunks (the later chunks attend the earlier ones' fp8 K/V),
    then decodes over the fp8 pool. e4m3 keeps 3 mantissa bits, so logits move by a few
    percent and long greedy continuations may part ways, as with any fp8 KV cache; the
    tiny model's first tokens are far enough apart to stay those of a full pool."""
    rng = random.Random(4)
    prompts = [random_prompt(rng, n) for n in (5, 17, 40, 64, 70, 90, 33, 100)]
    outputs = {}
    for kv_cache_dtype in ("auto", "fp8"):
        engine = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype,
                             max_num_batched_tokens=48)  # prompts split into chunks
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy(12))
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.token_ids)
        outputs[kv_cache_dtype] = done
        # The pool really holds e4m3 bytes (and some of them are not zero).
        assert engine.runner.kv_cache.dtype == (FP8_KV if kv_cache_dtype == "fp8"
                                                else torch.float32)
        assert engine.runner.kv_cache.view(torch.uint8).any()
    assert all(len(ids) == 12 for ids in outputs["fp8"].values())
    first = {key: {r: ids[0] for r, ids in done.items()} for key, done in outputs.items()}
    assert first["fp8"] == first["auto"]


def test_kv_cache_dtypes_that_cannot_run_are_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        EngineConfig(model=str(model_dir), kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="fp8 KV cache"):
        make_engine(model_dir, kv_cache_dtype="fp8", attention_backend="cpu")
