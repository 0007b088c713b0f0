"""Calibrated fp8 KV cache scales from the checkpoint: read under each format's names, used
with an fp8 pool on both CPU attention paths, ignored with a full-precision pool, and
refused when they are not one positive number."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.engine.test_engine import random_prompt
from tests.unit.engine.test_kv_cache_dtype import pool_logits
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine.kv_scales import split_kv_scale_names

# K and V of the "loud" checkpoint are the base model's times this, q and o_proj divided by
# it: the same model, with keys and values past e4m3's 448. A power of two keeps every
# product exact, so with scales of LOUD the pool holds the base model's bytes.
LOUD = 512.0
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kv-scales") / "base"
    save_tiny_llama(path, seed=3, num_hidden_layers=NUM_LAYERS)
    return path


def loud_variant(base_dir: Path, name: str, scales: dict[str, float]) -> Path:
    """The base model with K/V LOUD times larger (and the same outputs), plus `scales`."""
    path = base_dir.parent / name
    if path.exists():
        return path
    shutil.copytree(base_dir, path)
    tensors = load_file(str(base_dir / "model.safetensors"))
    for key in tensors:
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[key] = tensors[key] * LOUD
        elif key.endswith(("q_proj.weight", "o_proj.weight")):
            tensors[key] = tensors[key] / LOUD
    tensors.update({key: torch.tensor(value) for key, value in scales.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def per_layer(*suffixes: str, value: float = LOUD) -> dict[str, float]:
    return {f"model.layers.{i}.self_attn.{s}": value for i in range(NUM_LAYERS) for s in suffixes}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [random_prompt(rng, n) for n in (5, 17, 40)]


@pytest.mark.parametrize("suffixes", [
    ("k_scale", "v_scale"),  # vLLM, llm-compressor
    ("kv_scale",),  # AutoFP8: one for both
    ("k_proj.output_scale", "v_proj.output_scale"),  # compressed-tensors
    ("k_proj.k_scale", "v_proj.v_scale"),  # ModelOpt
])
def test_scaled_keys_and_values_in_an_fp8_pool_read_as_the_base_models(
    base_dir: Path, prompts: list[list[int]], suffixes: tuple[str, ...],
) -> None:
    """Keys and values of ~6,000 clamp to 448 in e4m3 with a scale of 1, and the logits go
    wrong; divided by the checkpoint's scales they are the base model's bytes, on the C++
    kernel and on the torch path alike."""
    base = pool_logits(base_dir, prompts, kv_cache_dtype="fp8")
    scaled = loud_variant(base_dir, "loud-" + "-".join(suffixes), per_layer(*suffixes))
    for backend in ("cpu", "torch"):
        logits = pool_logits(scaled, prompts, kv_cache_dtype="fp8", backend=backend)
        torch.testing.assert_close(logits, base, atol=1e-4, rtol=1e-4)
    unscaled = pool_logits(loud_variant(base_dir, "loud", {}), prompts, kv_cache_dtype="fp8")
    assert (unscaled - base).abs().max() > 0.5 * base.abs().max(), "clamped: far off"


def test_a_full_precision_pool_ignores_the_scales(
    base_dir: Path, prompts: list[list[int]],
) -> None:
    scaled = loud_variant(base_dir, "loud-k_scale-v_scale", per_layer("k_scale", "v_scale"))
    unscaled = loud_variant(base_dir, "loud", {})
    assert torch.equal(pool_logits(scaled, prompts, kv_cache_dtype="auto"),
                       pool_logits(unscaled, prompts, kv_cache_dtype="auto"))


@pytest.mark.parametrize(("scales", "message"), [
    (per_layer("k_scale", value=0.0), "must be positive and finite, got 0.0"),
    (per_layer("v_scale", value=float("nan")), "must be positive and finite, got nan"),
    ({"model.layers.7.self_attn.k_scale": 2.0}, "not an attention layer of this model"),
])
def test_scales_that_cannot_be_used_are_refused_at_load(
    base_dir: Path, prompts: list[list[int]], scales: dict[str, float], message: str,
) -> None:
    bad = loud_variant(base_dir, f"bad-{abs(hash(message))}", scales)
    with pytest.raises(ValueError, match=message):
        pool_logits(bad, prompts, kv_cache_dtype="fp8")


def test_a_scale_per_channel_is_refused(base_dir: Path, prompts: list[list[int]]) -> None:
    path = loud_variant(base_dir, "per-channel", {})
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(4)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"must be one number .* got shape \(4,\)"):
        pool_logits(path, prompts, kv_cache_dtype="fp8")


def test_the_names_each_format_uses_go_to_their_attention_layer() -> None:
    found, rest = split_kv_scale_names([
        "model.layers.0.self_attn.k_scale",
        "model.layers.0.self_attn.v_proj.output_scale",
        "model.layers.1.self_attn.kv_scale",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_proj.output_scale",  # not a KV scale
        "model.layers.2.mlp.k_scale",  # not after an attention module
    ])
    assert found == {
        "model.layers.0.self_attn": {"k": "model.layers.0.self_attn.k_scale",
                                     "v": "model.layers.0.self_attn.v_proj.output_scale"},
        "model.layers.1.self_attn": {"k": "model.layers.1.self_attn.kv_scale",
                                     "v": "model.layers.1.self_attn.kv_scale"},
    }
    assert rest == ["model.layers.1.self_attn.q_proj.weight",
                    "model.layers.1.self_attn.q_proj.output_scale", "model.layers.2.mlp.k_scale"]
