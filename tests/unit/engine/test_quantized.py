"""Quantized checkpoints run as Hugging Face runs the matrices they stand for.

For each format a tiny quantized Llama is written here from the format's layout
(`quantized_checkpoints.py`). The reference is Hugging Face's forward and greedy
`generate` on the dequantized matrices (computed from the integer values, not by
unpacking); the engine loads the packed checkpoint itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from tests.unit.engine import quantized_checkpoints as qc
from tests.unit.engine.tiny_models import hf_greedy_steps, save_tiny_llama
from workers.engine import LLM, SamplingParams
from workers.engine.loader import load_hf_config
from workers.engine.models import check_supported

FORMATS: dict[str, Callable[[Path], dict[str, torch.Tensor]]] = {
    "gptq-4bit-g32": lambda d: qc.write_gptq(d, bits=4, group_size=32, act_order=False),
    "gptq-4bit-actorder": lambda d: qc.write_gptq(d, bits=4, group_size=32, act_order=True),
    "gptq-8bit-onegroup": lambda d: qc.write_gptq(d, bits=8, group_size=-1, act_order=False),
    "awq-4bit-g32": lambda d: qc.write_awq(d, group_size=32),
    "fp8-tensor": lambda d: qc.write_fp8(d, strategy="tensor"),
    "fp8-channel": lambda d: qc.write_fp8(d, strategy="channel"),
    "fp8-block": lambda d: qc.write_fp8(d, strategy="block"),
}
PROMPTS = [[5, 9, 33, 7], list(range(3, 60)), [17] * 20, list(range(100, 3, -3))]


def _reference(model_dir: Path, meant: dict[str, torch.Tensor]) -> Any:
    """Hugging Face's Llama with the dequantized matrices in place of the linears."""
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config")
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    stored = load_file(model_dir / "model.safetensors")
    model.load_state_dict({name: meant.get(name, stored.get(name)) for name in model.state_dict()})
    return model


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_model_matches_hugging_face_on_its_dequantized_weights(
    fmt: str, tmp_path: Path
) -> None:
    save_tiny_llama(tmp_path, tie_word_embeddings=False)
    meant = FORMATS[fmt](tmp_path)
    reference = _reference(tmp_path, meant)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", skip_tokenizer_init=True,
              num_kv_blocks=256, block_size=16)
    loaded = dict(llm.engine.runner.model.named_parameters())
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        torch.testing.assert_close(loaded[name], meant[name])
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    num_compared = 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        tokens, margins = hf_greedy_steps(reference, prompt, 12)
        # Up to the first near tie (fp32 summation order alone could decide it), equal.
        decided = next((i for i, m in enumerate(margins) if m < 1e-3), len(tokens))
        assert out.token_ids[:decided] == tokens[:decided], fmt
        num_compared += decided
    assert num_compared >= 30, f"{fmt}: too few decided tokens to compare"


def test_unsupported_formats_are_refused_with_the_reason(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    for quantization, needle in [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3 bits"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {}}, "pack-quantized"),
    ]:
        config_path.write_text(json.dumps({**config, "quantization_config": quantization}))
        with pytest.raises(ValueError, match=needle):
            check_supported(load_hf_config(tmp_path))


@pytest.mark.parametrize("fmt", ["gptq-4bit-actorder", "awq-4bit-g32", "fp8-block"])
def test_weights_kept_quantized_decode_as_the_dequantized_ones(fmt: str, tmp_path: Path) -> None:
    """`quantized_weights="packed"`: the projections hold the packed tensors (a quarter
    of the bytes for 4 bits) and give the greedy tokens of the dequantized load. On the CPU
    without Triton they run by dequantizing per call; the kernels themselves are held to
    the same reference under the interpreter (interpreted/test_quant_gemm.py)."""
    save_tiny_llama(tmp_path, tie_word_embeddings=False)
    FORMATS[fmt](tmp_path)
    options: dict[str, Any] = {"dtype": "float32", "device": "cpu", "skip_tokenizer_init": True,
                               "num_kv_blocks": 64, "block_size": 16}
    packed = LLM(str(tmp_path), quantized_weights="packed", **options)
    dequantized = LLM(str(tmp_path), quantized_weights="dequantize", **options)

    def projection_bytes(llm: LLM) -> int:
        model = llm.engine.runner.model
        return sum(t.numel() * t.element_size() for name, t in
                   [*model.named_parameters(), *model.named_buffers()]
                   if "layers." in name and "norm" not in name)

    ratio = projection_bytes(packed) / projection_bytes(dequantized)
    assert ratio < (0.5 if fmt != "gptq-4bit-actorder" else 0.9), ratio
    params = SamplingParams(temperature=0, max_tokens=10)
    want = [o.token_ids for o in dequantized.generate(PROMPTS, params)]
    assert [o.token_ids for o in packed.generate(PROMPTS, params)] == want


def test_an_unknown_quantized_weights_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantized_weights"):
        LLM(str(tmp_path), quantized_weights="int3")
