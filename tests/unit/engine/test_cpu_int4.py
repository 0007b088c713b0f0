"""The CPU int4 kernels (`cpu_int4`: ours and torch's) against the matrix GPTQ/AWQ values
stand for, and 4-bit checkpoints kept packed on the CPU running through them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.engine import quantized_checkpoints as qc
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import LLM, SamplingParams, cpu_int4
from workers.engine.loader import prepare_cpu_projections
from workers.engine.models.quant_linear import QuantLinear
from workers.engine.quantization import QuantScheme
from workers.engine.quantized_layouts import IntWeights, pack_rows

pytestmark = pytest.mark.skipif(not cpu_int4.has_kernel(), reason="no CPU int4 kernel here")
needs_tile_kernel = pytest.mark.skipif(
    not cpu_int4.has_tile_kernel(), reason="our int4 kernel needs x86-64 with AVX2 and a compiler")
needs_aten_kernel = pytest.mark.skipif(
    not cpu_int4._has_aten_kernel(), reason="torch lacks its int4 kernel")


def _meant(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           group_size: int) -> torch.Tensor:
    """(N, K) float64 matrix of q (K, N) with per-group scales and zero points (G, N)."""
    groups = torch.arange(values.shape[0]) // group_size
    return ((values.double() - zeros.double()[groups]) * scales.double()[groups]).t()


def _weights(n: int, k: int, group_size: int,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (K, N), fp16-valued scales and zero points (G, N), as the formats store them."""
    values = torch.randint(0, 16, (k, n), generator=gen)
    scales = (torch.rand(k // group_size, n, generator=gen) * 0.05 + 1e-3).half().float()
    zeros = torch.randint(0, 16, (k // group_size, n), generator=gen).float()
    return values, scales, zeros


def _as_int8_rows(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) as our kernel takes it: each row's groups rounded to int8 steps of their
    largest |x| / 127 (float64); and each row's largest step."""
    groups = x.double().reshape(x.shape[0], -1, group_size)
    step = groups.abs().amax(dim=2, keepdim=True) / 127
    rounded = torch.round(groups / step.clamp_min(1e-300)) * step
    return rounded.reshape(x.shape), step.amax(dim=1)


@needs_tile_kernel
@pytest.mark.parametrize(("n", "k", "group_size"), [(16, 8, 4), (64, 64, 32), (48, 256, 64),
                                                    (96, 384, 128), (32, 512, 512)])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 9, 21])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "avx2"])
def test_our_kernel_computes_the_matrix_the_values_stand_for(
        n: int, k: int, group_size: int, rows: int, portable: bool) -> None:
    """Both paths (AVX-512 VNNI where built, and AVX2), every row count (passes of up to
    8 or 4 rows; more over weights unpacked ahead), any group size in fours, one tile to
    several. Against the int8-rounded activations the sum is exact but for fp32
    accumulation and the bf16 output; against x itself, within the activations' int8
    rounding."""
    gen = torch.Generator().manual_seed(n + k + rows)
    values, scales, zeros = _weights(n, k, group_size, gen)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[0, : k // 2] = 0  # a row's group of zeros has no scale to divide by
    weights = cpu_int4.tile_pack(values, scales, zeros, group_size)
    got = torch.ops.batchinfer_cpu.int4_gemm(x, weights.packed, weights.scales_zeros,
                                             group_size, portable).double()
    meant = _meant(values, scales, zeros, group_size).t()
    assert got.shape == (rows, n)
    # Each output its own: a swapped pair of outputs or inputs in the layout shows here.
    # Beyond fp32 sums and the bf16 output, an input whose product with 127 / largest
    # rounds the other way in fp32 than here moves by one step: allow two such.
    rounded, step = _as_int8_rows(x, group_size)
    want = rounded @ meant
    slack = 2 * step * meant.abs().amax(dim=0, keepdim=True)
    assert ((got - want).abs() <= 2**-8 * want.abs() + slack + 1e-6).all()
    exact = x.double() @ meant
    assert (got - exact).abs().max() <= 2e-2 * exact.abs().max()


def test_our_layout_gives_the_values_back() -> None:
    gen = torch.Generator().manual_seed(4)
    values, scales, zeros = _weights(48, 256, 64, gen)
    weights = cpu_int4.tile_pack(values, scales, zeros, 64)
    assert torch.equal(cpu_int4.tile_values(weights).long(), values)


@needs_tile_kernel
def test_our_kernel_refuses_what_does_not_match_its_layout() -> None:
    gen = torch.Generator().manual_seed(1)
    weights = cpu_int4.tile_pack(*_weights(32, 64, 32, gen), 32)
    with pytest.raises(RuntimeError, match="inputs"):
        cpu_int4.matmul(torch.randn(2, 60).bfloat16(), weights)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_int4.matmul(torch.randn(2, 64), weights)


@needs_tile_kernel
def test_bf16_takes_our_kernel_fp16_torchs_and_fp32_neither() -> None:
    gen = torch.Generator().manual_seed(2)
    values, scales, zeros = _weights(32, 128, 32, gen)
    assert isinstance(cpu_int4.pack(values, scales, zeros, 32, torch.bfloat16),
                      cpu_int4.TileInt4Weights)
    assert isinstance(cpu_int4.pack(values, scales, zeros, 32, torch.float16),
                      cpu_int4.Int4Weights)
    assert cpu_int4.pack(values, scales, zeros, 32, torch.float32) is None
    # Scales fp16 cannot hold exactly: torch's kernel, whose layout keeps them in bf16.
    inexact = scales + 1e-7
    assert isinstance(cpu_int4.pack(values, inexact, zeros, 32, torch.bfloat16),
                      cpu_int4.Int4Weights)


@needs_aten_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "group_size"), [(64, 64, 32), (48, 256, 64),
                                                    (96, 384, 128), (16, 512, 256)])
def test_torchs_kernel_computes_the_matrix_the_values_stand_for(
        n: int, k: int, group_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n + k)
    values, scales, zeros = _weights(n, k, group_size, gen)
    x = torch.randn(5, k, generator=gen)
    weights = cpu_int4.aten_pack(values, scales, zeros, group_size, dtype)
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
    projections = _projections(llm)
    assert projections and all(p.int4 is not None for p in projections)
    if cpu_int4.has_tile_kernel():
        assert all(isinstance(p.int4, cpu_int4.TileInt4Weights) for p in projections)
    assert any(p.has_perm for p in projections) == (fmt != "awq")
    _assert_projections_compute_their_matrices(projections)
    out = llm.generate([[5, 9, 33, 7]], SamplingParams(temperature=0, max_tokens=6))
    assert len(out[0].token_ids) == 6
    fp32 = LLM(str(tmp_path), dtype="float32", **options)
    assert all(m.int4 is None for m in fp32.engine.runner.model.modules()
               if isinstance(m, QuantLinear))


@needs_tile_kernel
def test_auto_keeps_4_bit_projections_packed_in_bf16_and_dequantizes_them_in_fp32(
        tmp_path: Path) -> None:
    """Where our kernel runs, "auto" keeps a bf16 model's 4-bit projections at half a byte
    a weight; fp32 (no int4 kernel) dequantizes them at load."""
    save_tiny_llama(tmp_path, tie_word_embeddings=False)
    qc.write_gptq(tmp_path, bits=4, group_size=32, act_order=True)
    options: dict[str, Any] = {"device": "cpu", "skip_tokenizer_init": True,
                               "num_kv_blocks": 64, "block_size": 16}
    llm = LLM(str(tmp_path), dtype="bfloat16", **options)
    projections = _projections(llm)
    assert projections
    for p in projections:  # the kernel's copy alone: half a byte a weight
        assert isinstance(p.int4, cpu_int4.TileInt4Weights) and p.qweight.numel() == 0
        assert p.int4.packed.numel() == p.in_features * p.out_features // 2
    _assert_projections_compute_their_matrices(projections)
    assert not _projections(LLM(str(tmp_path), dtype="float32", **options))


def test_a_projection_no_kernel_takes_keeps_its_matrix_unless_memory_was_asked_for() -> None:
    """40 outputs fit neither kernel's tiles of 16: under "auto" the projection keeps its
    dequantized matrix (made once), under "packed" it dequantizes on every call."""
    gen = torch.Generator().manual_seed(3)
    values, scales, zeros = _weights(40, 64, 32, gen)
    scheme = QuantScheme("gptq", bits=4, group_size=32)
    for keep_memory in (False, True):
        projection = QuantLinear(64, [40], False, scheme, torch.bfloat16)
        projection.load_shard(None, IntWeights(pack_rows(values.int(), 4), scales, zeros, None))
        prepare_cpu_projections(projection, torch.bfloat16, keep_memory=keep_memory)
        assert projection.int4 is None
        assert (projection.dense is None) == keep_memory
        _assert_projections_compute_their_matrices([projection])


def _projections(llm: LLM) -> list[QuantLinear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]


def _assert_projections_compute_their_matrices(projections: list[QuantLinear]) -> None:
    """Each one, act-order permutation and bias included, computes what its dequantized
    matrix does, at a decode's row count and a prefill's."""
    gen = torch.Generator().manual_seed(0)
    for projection in projections:
        for rows in (1, 3, 17):
            x = torch.randn(rows, projection.in_features, generator=gen).bfloat16()
            want = x.double() @ projection.dequantized().double().t()
            got = projection(x).double()
            assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@needs_tile_kernel
@pytest.mark.parametrize(("bits", "mode", "dtype"), [(4, "auto", torch.bfloat16),
                                                     (8, "auto", torch.float32),
                                                     (4, "dequantize", torch.float32)])
def test_auto_dtype_runs_a_4_bit_checkpoint_in_bf16_on_the_cpu(
        bits: int, mode: str, dtype: torch.dtype, tmp_path: Path) -> None:
    """A 4-bit checkpoint runs where our kernel takes it without a dtype set; others, and
    one the user asked to dequantize, stay in fp32, the CPU's default."""
    save_tiny_llama(tmp_path, tie_word_embeddings=False)
    qc.write_gptq(tmp_path, bits=bits, group_size=32, act_order=False)
    llm = LLM(str(tmp_path), device="cpu", skip_tokenizer_init=True, num_kv_blocks=64,
              block_size=16, quantized_weights=mode)
    assert llm.engine.runner.dtype == dtype
    assert bool(_projections(llm)) == (bits == 4 and mode == "auto")
