"""Matmuls with quantized weights that stay quantized in memory: int4/int8 and FP8 e4m3
weights dequantized tile by tile inside a Triton GEMM, so a 4-bit model reads a quarter
of the bytes a bf16 one does on every decode step.

Layouts (one CUDA device, or CPU under TRITON_INTERPRET=1), for x (M, K) -> out (M, N):
- int weights (`int_weight_gemm`): qweight (K / p, N) int32 with p = 32 / bits values per
  word, input k of column n at bits (k % p) * bits of word (k // p, n) (GPTQ's layout,
  which AWQ is repacked into at load); scales and zeros (G, N) float32 with input k in
  group k // group_size; w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]. Act-order
  checkpoints are stored with their inputs sorted by group, and x's columns are gathered
  in that order first (`perm`).
- FP8 weights (`fp8_weight_gemm`): weight (N, K) float8_e4m3fn viewed as uint8; scale
  (ceil(N / block_n), ceil(K / block_k)) float32 with w[n, k] = weight[n, k] *
  scale[n // block_n, k // block_k]: block_n = 1 and block_k >= K is a scale per output
  row (per channel, or per tensor repeated), applied once to the accumulator.

Accumulation in fp32; out in x's dtype. Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.kernels.interpreter import dot_options


@triton.jit
def _int_weight_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    m, n, k, group_size,
    stride_xm, stride_qk, stride_sg, stride_om,
    BITS: tl.constexpr,
    ONE_GROUP_PER_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    per_word: tl.constexpr = 32 // BITS
    value_mask: tl.constexpr = (1 << BITS) - 1
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row = rows < m
    is_col = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        is_k = ks < k
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=is_row[:, None] & is_k[None, :], other=0.0)
        words = tl.load(qweight_ptr + (ks // per_word)[:, None].to(tl.int64) * stride_qk
                        + cols[None, :], mask=is_k[:, None] & is_col[None, :], other=0)
        # An arithmetic shift drags the sign bit in; the mask keeps only this value's bits.
        q = ((words >> ((ks % per_word) * BITS)[:, None]) & value_mask).to(tl.float32)
        if ONE_GROUP_PER_TILE:
            group = k0 // group_size
            scale = tl.load(scales_ptr + group * stride_sg + cols, mask=is_col, other=0.0)
            zero = tl.load(zeros_ptr + group * stride_sg + cols, mask=is_col, other=0.0)
            w = (q - zero[None, :]) * scale[None, :]
        else:
            groups = (ks // group_size)[:, None].to(tl.int64) * stride_sg + cols[None, :]
            tile_mask = is_k[:, None] & is_col[None, :]
            scale = tl.load(scales_ptr + groups, mask=tile_mask, other=0.0)
            zero = tl.load(zeros_ptr + groups, mask=tile_mask, other=0.0)
            w = (q - zero) * scale
        if UPCAST:
            a = a.to(tl.float32)
        else:
            w = w.to(a.dtype)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=is_col, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_col[None, :])


@triton.jit
def _fp8_weight_gemm_kernel(
    x_ptr, weight_ptr, scale_ptr, bias_ptr, out_ptr,
    m, n, k, scale_block_n, scale_block_k,
    stride_xm, stride_wn, stride_sn, stride_om,
    SCALE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row = rows < m
    is_col = cols < n
    scale_rows = (cols // scale_block_n).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        is_k = ks < k
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=is_row[:, None] & is_k[None, :], other=0.0)
        # (BLOCK_K, BLOCK_N): column j of the tile is output row cols[j] of the weight.
        raw = tl.load(weight_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                      mask=is_k[:, None] & is_col[None, :], other=0)
        w = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if not SCALE_PER_ROW:  # block scales: one block along k per tile (BLOCK_K divides it)
            scale = tl.load(scale_ptr + scale_rows + k0 // scale_block_k, mask=is_col, other=0.0)
            w = w * scale[None, :]
        if UPCAST:
            a = a.to(tl.float32)
        else:
            w = w.to(a.dtype)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if SCALE_PER_ROW:
        acc *= tl.load(scale_ptr + scale_rows, mask=is_col, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=is_col, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_col[None, :])


def _tiles(m: int, n: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): decode batches are a few rows, so M tiles stay small there and
    the grid spreads over N instead."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    return block_m, block_n


def _block_k(k: int, divides: int | None) -> int:
    """BLOCK_K: the largest of 64/32/16 dividing `divides` (a group or scale block along
    K, so that a tile lies in one), or with None the one that fits K."""
    if divides is None:
        return 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    return next((size for size in (64, 32) if divides % size == 0), 16)


def int_weight_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, K) @ W (K, N) + bias, W given as packed ints; see the module docstring."""
    if bits not in (4, 8):
        raise ValueError(f"int_weight_gemm: {bits}-bit weights are not supported (4 or 8)")
    k = x.shape[1]
    n = qweight.shape[1]
    if qweight.shape[0] * (32 // bits) != k or scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"int_weight_gemm: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, "
                         f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)} do not fit")
    if perm is not None:
        x = x.index_select(1, perm)
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    one_group = group_size >= k
    block_k = _block_k(k, None if one_group else group_size)
    one_group_per_tile = one_group or group_size % block_k == 0
    block_m, block_n = _tiles(m, n)
    upcast, precision = dot_options(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int_weight_gemm_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else out, out,
        m, n, k, group_size if not one_group else k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits,
        ONE_GROUP_PER_TILE=one_group_per_tile,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast,
        DOT_PRECISION=precision,
    )  # fmt: skip
    return out


def fp8_weight_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_n: int,
    block_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, K) @ (weight * scale).T + bias for an FP8 e4m3 weight (N, K); see the module
    docstring for the scale's blocks."""
    n, k = weight.shape
    if x.shape[1] != k or scale.shape != (-(-n // block_n), -(-k // block_k)):
        raise ValueError(f"fp8_weight_gemm: x {tuple(x.shape)}, weight {tuple(weight.shape)} "
                         f"and scale {tuple(scale.shape)} with blocks ({block_n}, {block_k}) "
                         "do not fit")
    x = x.contiguous()
    raw = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    per_row = block_k >= k
    tile_k = _block_k(k, None if per_row else block_k)
    if not per_row and block_k % tile_k:
        raise ValueError(f"fp8_weight_gemm: scale blocks of {block_k} inputs are not a "
                         "multiple of 16")
    block_m, tile_n = _tiles(m, n)
    upcast, precision = dot_options(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, tile_n))
    _fp8_weight_gemm_kernel[grid](
        x, raw, scale, bias if bias is not None else out, out,
        m, n, k, block_n, block_k,
        x.stride(0), raw.stride(0), scale.stride(0), out.stride(0),
        SCALE_PER_ROW=per_row,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=tile_n,
        BLOCK_K=tile_k,
        UPCAST=upcast,
        DOT_PRECISION=precision,
    )  # fmt: skip
    return out
