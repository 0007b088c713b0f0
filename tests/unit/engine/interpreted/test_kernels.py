"""The Triton kernels against their torch references, on CPU tensors via the interpreter.

fp32 and fp16 run natively in the interpreter; bf16 tiles are loaded as bf16 and computed
in fp32 there (its bf16 arithmetic is wrong), so the bf16 cases check loads, stores,
layouts and masks, and the fp32 arithmetic the GPU runs on bf16 data.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.unit.engine.test_attention import SHAPES, run_backend
from workers.engine.attention import TorchAttentionBackend
from workers.engine.kernels.kv_write import kv_write
from workers.engine.kernels.paged_attention import paged_attention
from workers.engine.kernels.reference import paged_attention_reference, write_kv_reference
from workers.engine.kv_dtypes import FP8_KV, FP8_KV_MAX
from workers.engine.triton_attention import TritonAttentionBackend

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# (cached, new) per sequence: decodes of several lengths, chunks with and without a cache,
# one crossing a 32-query tile.
STEP = [(0, 1), (5, 1), (16, 1), (40, 1), (0, 12), (20, 7), (3, 40)]


def paged_inputs(
    step: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Random q/k/v, a pool of random cached K/V and scattered tables for `step` (tensors,
    typed Any so they spread into keyword arguments of other types too)."""
    gen = torch.Generator().manual_seed(0)
    num_tokens = sum(n for _, n in step)
    needed = [-(-(c + n) // block_size) for c, n in step]
    width = max(needed) + 1  # a wider table than needed: the tail must never be read
    num_blocks = sum(needed) + 2
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    tables = torch.zeros(len(step), width, dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(ids[:n])
        tables[i, n:] = num_blocks + 1000  # out of the pool: a read past the prefix crashes
        ids = ids[n:]
    cu = [0]
    for _, n in step:
        cu.append(cu[-1] + n)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    # q/k/v as views of one fused projection, like the model's.
    qkv = rand(num_tokens, heads + 2 * kv_heads, head_dim)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    return {
        "q": q,
        "k": k,
        "v": v,
        "k_cache": rand(num_blocks, block_size, kv_heads, head_dim),
        "v_cache": rand(num_blocks, block_size, kv_heads, head_dim),
        "cu_seqlens_q": torch.tensor(cu, dtype=torch.int32),
        "seq_lens": torch.tensor([c + n for c, n in step], dtype=torch.int32),
        "block_tables": tables,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(6, 2, 16, 16), (2, 2, 24, 32)],
    ids=["gqa3-d16-b16", "mha-d24-b32"],
)
def test_paged_attention_matches_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Mixed prefill + decode step, GQA or not, a head size that is no power of two."""
    t = paged_inputs(STEP, heads, kv_heads, head_dim, block_size, dtype)
    out = torch.full_like(t["q"], float("nan"), memory_format=torch.contiguous_format)
    scale = head_dim**-0.5
    max_query_len = max(n for _, n in STEP)
    paged_attention(**t, out=out, scale=scale, max_query_len=max_query_len)
    ref = paged_attention_reference(**t, scale=scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_paged_attention_decode_grid() -> None:
    """max_query_len 1 (the CUDA-graph launch) over decodes only matches the reference."""
    step = [(0, 1), (15, 1), (16, 1), (33, 1)]
    t = paged_inputs(step, 6, 2, 16, 16, torch.float32)
    out = torch.empty_like(t["q"], memory_format=torch.contiguous_format)
    paged_attention(**t, out=out, scale=0.25, max_query_len=1)
    ref = paged_attention_reference(**t, scale=0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_write_matches_reference(dtype: torch.dtype) -> None:
    """Rows land in exactly their slots, bit for bit; other slots keep their values."""
    t = paged_inputs(STEP, 6, 2, 24, 16, dtype)
    num_slots = t["k_cache"].shape[0] * t["k_cache"].shape[1]
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(1))
    slots = slots[: t["k"].shape[0]]
    k_cache, v_cache = t["k_cache"].clone(), t["v_cache"].clone()
    kv_write(t["k"], t["v"], k_cache, v_cache, slots)
    write_kv_reference(t["k"], t["v"], t["k_cache"], t["v_cache"], slots)
    assert torch.equal(k_cache, t["k_cache"]) and torch.equal(v_cache, t["v_cache"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_reads_an_fp8_pool(dtype: torch.dtype) -> None:
    """The cached prefix from e4m3 blocks, widened as read; the new keys as they came."""
    t = paged_inputs(STEP, 6, 2, 16, 16, dtype)
    t["k_cache"], t["v_cache"] = t["k_cache"].to(FP8_KV), t["v_cache"].to(FP8_KV)
    out = torch.full_like(t["q"], float("nan"), memory_format=torch.contiguous_format)
    paged_attention(**t, out=out, scale=0.25, max_query_len=max(n for _, n in STEP))
    ref = paged_attention_reference(**t, scale=0.25)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # What it read were the fp8 values: against the unrounded pool it is off.
    exact = paged_inputs(STEP, 6, 2, 16, 16, dtype)
    assert not torch.allclose(out.float(), paged_attention_reference(**exact, scale=0.25),
                              atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_to_an_fp8_pool(dtype: torch.dtype) -> None:
    """Rows rounded to e4m3 in their slots, out-of-range values clamped to +-448 (not NaN)."""
    t = paged_inputs(STEP, 6, 2, 24, 16, dtype)
    t["k"][0] *= 1e4  # far beyond e4m3's range
    t["v"][1] *= 1e-3  # into its subnormals
    slots = torch.randperm(t["k_cache"].numel() // (2 * 24),
                           generator=torch.Generator().manual_seed(1))[: t["k"].shape[0]]
    k_cache = torch.zeros(t["k_cache"].shape, dtype=FP8_KV)
    v_cache = torch.zeros_like(k_cache)
    kv_write(t["k"], t["v"], k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv_reference(t["k"], t["v"], k_ref, v_ref, slots)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    stored = k_cache.view(-1, 2, 24)[slots[0]].float()
    assert not stored.isnan().any() and stored.abs().max() == FP8_KV_MAX


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_backend_matches_dense_and_torch_backend(dtype: torch.dtype) -> None:
    """The backend as the model calls it: KV write, then attention over the pool."""
    cpu = torch.device("cpu")
    out, ref = run_backend(TritonAttentionBackend(6, 2, 16), 16, cpu, dtype, SHAPES)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    if dtype == torch.float32:
        torch_out, _ = run_backend(TorchAttentionBackend(6, 2, 16), 16, cpu, dtype, SHAPES)
        torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("window", "softcap"), [(24, 0.0), (5, 3.0), (1, 0.0), (0, 2.0)],
    ids=["window24", "window5-softcap", "window1", "softcap"],
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_window_and_softcap(window: int, softcap: float, block_size: int) -> None:
    """Sliding windows (walks start at the first visible block and tile; keys before a
    row's window masked) and soft-capped scores, in decodes and chunks, fp32."""
    step = [*STEP, (70, 1), (30, 33), (100, 40)]
    t = paged_inputs(step, 6, 2, 16, block_size, torch.float32)
    out = torch.full_like(t["q"], float("nan"), memory_format=torch.contiguous_format)
    max_query_len = max(n for _, n in step)
    paged_attention(**t, out=out, scale=0.25, max_query_len=max_query_len,
                    window=window, softcap=softcap)
    ref = paged_attention_reference(**t, scale=0.25, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
