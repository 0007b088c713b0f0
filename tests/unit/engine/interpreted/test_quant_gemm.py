"""The dequantize-in-GEMM kernels against dequantize-then-matmul, under the interpreter.

The references are the load-time dequantizers of `quantization.py` applied to the
checkpoint tensors as stored; the kernels read the same tensors re-laid by
`quantized_layouts.py`, so a mistake in either the re-laying or the kernel shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.engine import quantized_checkpoints as qc
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import LLM, SamplingParams
from workers.engine.kernels.quant_gemm import fp8_weight_gemm, int_weight_gemm
from workers.engine.models.quant_linear import QuantLinear
from workers.engine.quantization import (
    QuantScheme,
    dequantize_awq,
    dequantize_fp8,
    dequantize_gptq,
)
from workers.engine.quantized_layouts import awq_int_weights, fp8_weights, gptq_int_weights

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _gptq(n: int, k: int, bits: int, group_size: int, act_order: bool, seed: int = 0
          ) -> tuple[QuantScheme, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    size = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
    groups = torch.empty(k, dtype=torch.int64)
    groups[order] = torch.arange(k) // size
    q, zeros, scales = qc._quantize_groups(w, groups, k // size, bits)
    parts = {"qweight": qc._pack_rows(q, bits), "qzeros": qc._pack_cols(zeros - 1, bits),
             "scales": scales, "g_idx": groups.to(torch.int32)}
    return QuantScheme("gptq", bits, group_size, zeros_offset=1), parts


def _awq(n: int, k: int, group_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    groups = torch.arange(k) // group_size
    q, zeros, scales = qc._quantize_groups(w, groups, k // group_size, 4)
    return {"qweight": qc._pack_cols(q, 4, qc.AWQ_ORDER),
            "qzeros": qc._pack_cols(zeros, 4, qc.AWQ_ORDER), "scales": scales}


def _fp8(n: int, k: int, strategy: str, block: int = 32, seed: int = 0
         ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    if strategy == "block":
        scale = torch.rand(-(-n // block), -(-k // block), generator=gen) / 100 + 1e-3
        full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        return (w / full).to(torch.float8_e4m3fn), scale
    scale = w.abs().amax() / 448 if strategy == "tensor" else w.abs().amax(1, keepdim=True) / 448
    return (w / scale).to(torch.float8_e4m3fn), scale


def _x(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(dtype)


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "bits", "group_size", "act_order"), [
    (1, 80, 128, 4, 32, False),     # a decode row; N off the tile grid
    (7, 64, 256, 4, 128, True),     # act-order: inputs gathered into group order
    (33, 48, 96, 8, -1, False),     # 8-bit, one group, K off the 64 tile
    (5, 32, 64, 4, 8, False),       # groups smaller than a tile: scales read per row
])
def test_int_weights_equal_dequantize_then_matmul(
    dtype: torch.dtype, m: int, n: int, k: int, bits: int, group_size: int, act_order: bool
) -> None:
    scheme, parts = _gptq(n, k, bits, group_size, act_order)
    w = gptq_int_weights(scheme, parts["qweight"], parts["qzeros"], parts["scales"],
                         parts["g_idx"])
    assert (w.perm is not None) == act_order
    bias = torch.randn(n).to(dtype)
    x = _x(m, k, dtype)
    reference = dequantize_gptq(scheme, parts["qweight"], parts["qzeros"], parts["scales"],
                                parts["g_idx"])
    expected = x.float() @ reference.t() + bias.float()
    got = int_weight_gemm(x, w.qweight, w.scales, w.zeros, bits=bits,
                          group_size=k if group_size == -1 else group_size, bias=bias,
                          perm=w.perm)
    _close(got, expected, dtype)


def test_awq_weights_repacked_for_the_kernel_equal_their_dequantized_matrix() -> None:
    parts = _awq(96, 128, 32)
    w = awq_int_weights(parts["qweight"], parts["qzeros"], parts["scales"])
    x = _x(9, 128, torch.float32)
    expected = x @ dequantize_awq(QuantScheme("awq", 4, 32), **parts).t()
    got = int_weight_gemm(x, w.qweight, w.scales, w.zeros, bits=4, group_size=32)
    _close(got, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "strategy", "block"), [
    (1, 96, 64, "tensor", 0),
    (20, 72, 80, "channel", 0),
    (3, 64, 128, "block", 32),
    (40, 100, 256, "block", 128),   # N off the block grid: the last block is partial
])
def test_fp8_weights_equal_dequantize_then_matmul(
    dtype: torch.dtype, m: int, n: int, k: int, strategy: str, block: int
) -> None:
    weight, scale = _fp8(n, k, strategy, block or 32)
    w = fp8_weights(weight, scale, (block, block) if block else None)
    assert w is not None
    x = _x(m, k, dtype)
    expected = x.float() @ dequantize_fp8(weight, scale, (block, block) if block else None).t()
    got = fp8_weight_gemm(x, w.weight, w.scale, block_n=w.block_n, block_k=w.block_k)
    _close(got, expected, dtype)


def test_a_planted_bug_in_the_input_order_is_caught() -> None:
    """The comparison can fail: an act-order weight read in checkpoint input order (the
    gather left out) is a different product."""
    scheme, parts = _gptq(64, 128, 4, 32, act_order=True)
    w = gptq_int_weights(scheme, parts["qweight"], parts["qzeros"], parts["scales"],
                         parts["g_idx"])
    x = _x(4, 128, torch.float32)
    expected = x @ dequantize_gptq(scheme, parts["qweight"], parts["qzeros"], parts["scales"],
                                   parts["g_idx"]).t()
    right = int_weight_gemm(x, w.qweight, w.scales, w.zeros, bits=4, group_size=32, perm=w.perm)
    wrong = int_weight_gemm(x, w.qweight, w.scales, w.zeros, bits=4, group_size=32)
    _close(right, expected, torch.float32)
    assert not torch.allclose(wrong, expected, atol=1e-2)


# One int and one FP8 format, every projection packed (fused q/k/v and gate/up included);
# AWQ's repacking and act-order's input order are held to the reference kernel by kernel
# above, and whole models of every format run packed on the CPU in test_quantized.py.
PACKED = {"gptq-8bit-g32": 8, "fp8-block": 8}


@pytest.mark.parametrize("fmt", list(PACKED))
def test_a_model_with_packed_weights_decodes_as_the_dequantized_one(
    fmt: str, tmp_path: Path
) -> None:
    """The whole tiny model through QuantLinear (fused q/k/v and gate/up included) gives
    the greedy tokens of the same checkpoint dequantized at load."""
    writers = {
        "gptq-8bit-g32": lambda d: qc.write_gptq(d, bits=8, group_size=32, act_order=False),
        "fp8-block": lambda d: qc.write_fp8(d, strategy="block"),
    }
    save_tiny_llama(tmp_path, tie_word_embeddings=False)
    writers[fmt](tmp_path)
    options = {"dtype": "float32", "device": "cpu", "skip_tokenizer_init": True,
               "num_kv_blocks": 64, "block_size": 16}
    packed = LLM(str(tmp_path), quantized_weights="packed", **options)
    projections = [m for m in packed.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(projections) == PACKED[fmt]
    dequantized = LLM(str(tmp_path), quantized_weights="dequantize", **options)
    prompts = [[5, 9, 33, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=4)
    want = [o.token_ids for o in dequantized.generate(prompts, params)]
    assert [o.token_ids for o in packed.generate(prompts, params)] == want
