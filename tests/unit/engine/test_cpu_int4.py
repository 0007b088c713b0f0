"""The CPU int4 kernel's layout (`cpu_int4`) against the matrix GPTQ/AWQ values stand for,
and 4-bit checkpoints kept packed on the CPU running through it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.engine import quantized_checkpoints as qc
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import LLM, SamplingParams, cpu_int4
from workers.engine.models.quant_linear import QuantLinear

pytestmark = pytest.mark.skipif(not cpu_int4.has_kernel(), reason="torch lacks the int4 kernel")


def _meant(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           group_size: int) -> torch.Tensor:
    """(N, K) float64 matrix of q (K, N) with per-group scales and zero points (G, N)."""
    groups = torch.arange(values.shape[0]) // group_size
    return ((values.double() - zeros.double()[groups]) * scales.double()[groups]).t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "group_size"), [(64, 64, 32), (48, 256, 64),
                                                    (96, 384, 128), (16, 512, 256)])
def test_the_kernel_computes_the_matrix_the_values_stand_for(
        n: int, k: int, group_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n + k)
    values = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(k // group_size, n, generator=gen) * 0.05 + 1e-3
    zeros = torch.randint(0, 16, (k // group_size, n), generator=gen).float()
    x = torch.randn(5, k, generator=gen)
    weights = cpu_int4.pack(values, scales, zeros, group_size, dtype)
    got = cpu_int4.matmul(x.to(dtype), weights).double()
    want = x.to(dtype).double() @ _meant(values, scales, zeros, group_size).t()
    # fp32: summation order only; bf16: the scales, offsets and products rounded to bf16.
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tolerance * want.abs().max()


def test_shapes_outside_the_kernels_layout_do_not_fit() -> None:
    assert cpu_int4.fits(64, 64, 32)
    assert not cpu_int4.fits(64, 64, 16)  # group sizes 32-256 only
    assert not cpu_int4.fits(64, 40, 32)  # outputs in multiples of 16
    assert not cpu_int4.fits(96, 64, 64)  # inputs in whole groups
    assert not cpu_int4.fits(512, 64, 512)


@pytest.mark.parametrize("fmt", ["gptq-actorder", "awq"])
def test_packed_4_bit_projections_run_the_kernel_in_bf16(fmt: str, tmp_path: Path) -> None:
    """`quantized_weights="packed"` in bf16: every 4-bit projection holds the kernel's copy
    and computes, act-order permutation and bias included, what its dequantized matrix
    does; in fp32 (where the kernel is slow) none does."""
    save_tiny_llama(tmp_path, tie_word_embeddings=False)
    if fmt == "awq":
        qc.write_awq(tmp_path, group_size=32)
    else:
        qc.write_gptq(tmp_path, bits=4, group_size=32, act_order=True)
    options: dict[str, Any] = {"device": "cpu", "skip_tokenizer_init": True,
                               "num_kv_blocks": 64, "block_size": 16,
                               "quantized_weights": "packed"}
    llm = LLM(str(tmp_path), dtype="bfloat16", **options)
    projections = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert projections and all(p.int4 is not None for p in projections)
    assert any(p.has_perm for p in projections) == (fmt != "awq")
    gen = torch.Generator().manual_seed(0)
    for projection in projections:
        for rows in (1, 3, 17):
            x = torch.randn(rows, projection.in_features, generator=gen).bfloat16()
            want = x.double() @ projection.dequantized().double().t()
            got = projection(x).double()
            assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    out = llm.generate([[5, 9, 33, 7]], SamplingParams(temperature=0, max_tokens=6))
    assert len(out[0].token_ids) == 6
    fp32 = LLM(str(tmp_path), dtype="float32", **options)
    assert all(m.int4 is None for m in fp32.engine.runner.model.modules()
               if isinstance(m, QuantLinear))
