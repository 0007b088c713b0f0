"""GPTQ and AWQ 4-bit projections kept packed on the CPU, run by torch's int4 weight-only
GEMM (`aten._weight_int4pack_mm_for_cpu`) instead of being dequantized on every call.

Where: `quantized_weights="packed"` on the CPU, for models run in bf16 or fp16 (the
kernel's fp32 path measured 5-50x slower than its bf16 one). The weights then take half
a byte each plus a (scale, offset) pair per group, against 2 bytes dequantized to bf16:
the mode for a model that must fit in memory. "auto" still dequantizes at load on the CPU:
on a 1B Llama's projections (AVX-512, 2 threads) the kernel reads a decode step's weights
2.8x faster than oneDNN's bf16 GEMM at 1 row, 1.7x at 4, but 0.9x at 8 and 0.6x at 16 (it
turns compute-bound), and a prefill's hundreds of rows run far slower than in bf16.

Layout: GPTQ and AWQ mean w[o, i] = s[g, o] (q[o, i] - z[g, o]) for the group g of input
i; torch's kernel computes (q - 8) s' + b', so s' = s and b' = s (8 - z). The values q
(N, K), in [0, 16), are re-packed once by `_convert_weight_to_int4pack_for_cpu`. Inputs are
in the sorted order of `quantized_layouts` (act-order checkpoints have their inputs
permuted so each group is a run of `group_size`); the caller permutes x the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The group sizes the kernel accepts; outputs must come in multiples of 16.
GROUP_SIZES = (32, 64, 128, 256)
OUTPUT_MULTIPLE = 16
# Activation dtypes it runs fast.
DTYPES = (torch.bfloat16, torch.float16)


def has_kernel() -> bool:
    """This torch has the kernel."""
    ops = torch.ops.aten
    return (hasattr(ops, "_weight_int4pack_mm_for_cpu")
            and hasattr(ops, "_convert_weight_to_int4pack_for_cpu"))


def fits(in_features: int, out_features: int, group_size: int) -> bool:
    """Whether a projection of this shape and group size has the kernel's layout."""
    return (group_size in GROUP_SIZES and in_features % group_size == 0
            and out_features % OUTPUT_MULTIPLE == 0)


@dataclass(frozen=True, slots=True)
class Int4Weights:
    """A projection's weights in the kernel's layout."""

    packed: torch.Tensor  # (N, K / 2) uint8
    scales_and_offsets: torch.Tensor  # (G, N, 2), in the activations' dtype
    group_size: int


def pack(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
         dtype: torch.dtype) -> Int4Weights:
    """From q (K, N) in [0, 16) and per-group scales and zero points (G, N), for
    activations of `dtype`."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        values.t().contiguous().to(torch.int32), 1)
    offsets = scales * (8 - zeros)
    return Int4Weights(packed, torch.stack([scales, offsets], dim=2).to(dtype).contiguous(),
                       group_size)


def matmul(x: torch.Tensor, weights: Int4Weights) -> torch.Tensor:
    """x (M, K) in the activations' dtype -> (M, N)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.contiguous(), weights.packed, weights.group_size, weights.scales_and_offsets)
