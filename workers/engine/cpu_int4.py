"""GPTQ and AWQ 4-bit projections kept packed on the CPU, run by an int4 GEMM instead of
being dequantized on every call.

Two kernels, the faster one that runs here:

- our own (`kernels/cpu_int4_gemm.cpp`, `torch.ops.batchinfer_cpu.int4_gemm`), for bf16
  activations on x86-64 CPUs with AVX2 (with AVX-512 VNNI where the CPU has it: Ice Lake,
  Zen 4 and later). It multiplies the raw 4-bit values by the activations rounded to int8
  per row and group, and applies each group's scales and zero point once per group, so it
  stays close to reading the weights: a random-weight Llama-3.2-1B decodes 2.2x as fast as
  in bf16 at batches 1-8 (Zen 4, 2 threads, `bench/quantized_decode.py`), and its prefill is
  no slower. With it, "auto" keeps a bf16 model's 4-bit projections packed on the CPU.
- torch's (`aten._weight_int4pack_mm_for_cpu`), elsewhere, for bf16 or fp16 (its fp32 path
  measured 5-50x slower than its bf16 one): it dequantizes each weight to float inside the
  loop and turns compute-bound at a handful of rows (2.8x bf16 at 1 row, 1.7x at 4, 0.9x
  at 8, 0.6x at 16; a prefill far slower), so there only `quantized_weights="packed"`
  uses it, for a model that must fit in memory.

Layouts: GPTQ and AWQ mean w[o, i] = s[g, o] (q[o, i] - z[g, o]) for the group g of input
i. Ours: outputs in tiles of 16; per tile and 4 inputs, 32 bytes whose nibbles sit where
the kernel's vdpbf16ps lanes read them (the .cpp file says how), and per tile and group 16
fp16 scales and 16 fp16 zero points. torch's computes (q - 8) s' + b', so s' = s and
b' = s (8 - z), with q (N, K) re-packed by `_convert_weight_to_int4pack_for_cpu`. Inputs
are in the sorted order of `quantized_layouts` (act-order checkpoints have their inputs
permuted so each group is a run of `group_size`); the caller permutes x the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine import cpu_kernels

# torch's kernel: the group sizes it accepts; outputs must come in multiples of 16.
GROUP_SIZES = (32, 64, 128, 256)
OUTPUT_MULTIPLE = 16
# Activation dtypes torch's kernel runs fast; ours runs bf16.
DTYPES = (torch.bfloat16, torch.float16)


def has_kernel() -> bool:
    """This torch has its int4 kernel, or ours is built here."""
    return has_tile_kernel() or _has_aten_kernel()


def _has_aten_kernel() -> bool:
    ops = torch.ops.aten
    return (hasattr(ops, "_weight_int4pack_mm_for_cpu")
            and hasattr(ops, "_convert_weight_to_int4pack_for_cpu"))


def has_tile_kernel() -> bool:
    """Our kernel is built and loaded here, and this CPU runs it (x86-64 with AVX2 or
    AVX-512; a C++ compiler)."""
    return (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
            and cpu_kernels.load() is None and hasattr(torch.ops.batchinfer_cpu, "int4_gemm"))


def fits(in_features: int, out_features: int, group_size: int) -> bool:
    """Whether a projection of this shape and group size has torch's kernel's layout."""
    return (group_size in GROUP_SIZES and in_features % group_size == 0
            and out_features % OUTPUT_MULTIPLE == 0)


def tile_fits(in_features: int, out_features: int, group_size: int) -> bool:
    """Whether a projection of this shape and group size has our kernel's layout."""
    return (group_size % 4 == 0 and in_features % group_size == 0
            and out_features % OUTPUT_MULTIPLE == 0)


@dataclass(frozen=True, slots=True)
class Int4Weights:
    """A projection's weights in torch's kernel's layout."""

    packed: torch.Tensor  # (N, K / 2) uint8
    scales_and_offsets: torch.Tensor  # (G, N, 2), in the activations' dtype
    group_size: int


@dataclass(frozen=True, slots=True)
class TileInt4Weights:
    """A projection's weights in our kernel's layout (module docstring)."""

    packed: torch.Tensor  # (N / 16, K / 4, 32) uint8
    scales_zeros: torch.Tensor  # (N / 16, G, 32) fp16
    group_size: int


def pack(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
         dtype: torch.dtype) -> Int4Weights | TileInt4Weights | None:
    """From q (K, N) in [0, 16) and per-group scales and zero points (G, N), for
    activations of `dtype`: our kernel's copy where it runs, else torch's, else None."""
    in_features, out_features = values.shape
    if (dtype == torch.bfloat16 and tile_fits(in_features, out_features, group_size)
            and has_tile_kernel() and _exact_in_fp16(scales) and _exact_in_fp16(zeros)):
        return tile_pack(values, scales, zeros, group_size)
    if (dtype not in DTYPES or not fits(in_features, out_features, group_size)
            or not _has_aten_kernel()):
        return None
    return aten_pack(values, scales, zeros, group_size, dtype)


def aten_pack(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              dtype: torch.dtype) -> Int4Weights:
    """torch's kernel's layout of q (K, N), scales and zero points (G, N), for `dtype`."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        values.t().contiguous().to(torch.int32), 1)
    offsets = scales * (8 - zeros)
    return Int4Weights(packed, torch.stack([scales, offsets], dim=2).to(dtype).contiguous(),
                       group_size)


def tile_pack(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int) -> TileInt4Weights:
    """Our kernel's layout of q (K, N), scales and zero points (G, N)."""
    in_features, out_features = values.shape
    tiles, quads = out_features // OUTPUT_MULTIPLE, in_features // 4
    half = OUTPUT_MULTIPLE // 2
    # (tile, which half of its outputs, output i in it, quad, j): input 4 quad + j.
    q = values.t().reshape(tiles, 2, half, quads, 4).to(torch.uint8)
    # Byte 4i + j of a quad: output i in its low nibble, output 8 + i in its high one.
    packed = (q[:, 0] | (q[:, 1] << 4)).permute(0, 2, 1, 3)
    groups = in_features // group_size

    def by_tile(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(groups, tiles, OUTPUT_MULTIPLE).permute(1, 0, 2)

    scales_zeros = torch.cat([by_tile(scales), by_tile(zeros)], dim=2)
    return TileInt4Weights(packed.reshape(tiles, quads, 32).contiguous(),
                           scales_zeros.to(torch.float16).contiguous(), group_size)


def tile_values(weights: TileInt4Weights) -> torch.Tensor:
    """q (K, N) back from our kernel's layout (`tile_pack`'s inverse)."""
    tiles, quads, _ = weights.packed.shape
    half = OUTPUT_MULTIPLE // 2
    q = weights.packed.reshape(tiles, quads, half, 4).permute(0, 2, 1, 3)
    both = torch.stack([q & 0x0F, q >> 4], dim=1)  # (tile, half, i, quad, j)
    return both.reshape(tiles * OUTPUT_MULTIPLE, quads * 4).t()


def matmul(x: torch.Tensor, weights: Int4Weights | TileInt4Weights) -> torch.Tensor:
    """x (M, K) in the activations' dtype -> (M, N)."""
    if isinstance(weights, TileInt4Weights):
        return torch.ops.batchinfer_cpu.int4_gemm(x.contiguous(), weights.packed,
                                                  weights.scales_zeros, weights.group_size)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.contiguous(), weights.packed, weights.group_size, weights.scales_and_offsets)


def _exact_in_fp16(t: torch.Tensor) -> bool:
    """GPTQ and AWQ store fp16 scales, so this holds for their checkpoints."""
    return bool(torch.equal(t.to(torch.float16).to(t.dtype), t))
