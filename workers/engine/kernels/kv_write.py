"""The KV-cache write as one Triton kernel: a step's new K and V rows into their pool slots.

Tensors (all on one CUDA device, or CPU under TRITON_INTERPRET=1):
- k, v: (N, Hkv, D), any strides whose last dimension is contiguous (they are views of
  the fused qkv projection's output);
- k_cache, v_cache: (num_blocks, block_size, Hkv, D), contiguous, the dtype of k/v;
- slot_mapping: (N,) int64, slot = block * block_size + offset of each row.

Grid: one program per token row; each copies that row's Hkv x D values of K and of V
(Hkv and D padded to powers of two and masked), so a step writes its KV in one launch
instead of two `index_copy_` kernels per layer with their index checks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.kv_dtypes import FP8_KV, FP8_KV_MAX


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32,
    so that the cast to fp8 is exact in any converter: a GPU's rounds the same way, and
    Triton's interpreter, whose own rounding does not carry into the exponent (1.95 became
    1.0), then has nothing to round."""
    sign = x.to(tl.int32, bitcast=True) & -2147483648  # 0x80000000
    magnitude = tl.abs(x)
    # Below e4m3's smallest normal (2^-6) its steps are 2^-9: shifted up by 2^-6, such a
    # value has just those steps as its 3 kept mantissa bits.
    subnormal = magnitude < 0.015625
    magnitude = tl.where(subnormal, magnitude + 0.015625, magnitude)
    bits = magnitude.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 of 23 bits: 0xFFF00000
    rounded = bits.to(tl.float32, bitcast=True)
    rounded = tl.where(subnormal, rounded - 0.015625, rounded)
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    CLAMP: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + row)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    dst = block * stride_cache_block + offset * stride_cache_slot
    dst += heads[:, None] * stride_cache_head + dims[None, :]
    k = tl.load(k_ptr + row * stride_kn + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + row * stride_vn + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if CLAMP > 0:  # an fp8 pool: clamped to its finite range, rounded, then stored exactly
        k = _round_to_e4m3(tl.clamp(k.to(tl.float32), -CLAMP, CLAMP))
        v = _round_to_e4m3(tl.clamp(v.to(tl.float32), -CLAMP, CLAMP))
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_kv_write_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ValueError for arguments the kernel would silently misread."""
    tensors = {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"kv_write tensors must share one device, got {devices}")
    if k.shape != v.shape or k.dim() != 3 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"k and v must be (N, Hkv, D) with a contiguous last dim: {k.shape}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold rows {tuple(k.shape[1:])}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k.dtype != v.dtype or k_cache.dtype != v_cache.dtype or k_cache.dtype not in (k.dtype,
                                                                                     FP8_KV):
        raise ValueError(f"cache dtype {k_cache.dtype} is neither k/v's ({k.dtype}) nor "
                         f"{FP8_KV}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be ({k.shape[0]},) int64, got {slot_mapping.shape}")


@torch.library.custom_op("batchinfer::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k/v (N, Hkv, D) into the pool slots slot_mapping (N,), one launch for both."""
    check_kv_write_args(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    _kv_write_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        CLAMP=FP8_KV_MAX if k_cache.dtype == FP8_KV else 0.0,
    )  # fmt: skip


@kv_write.register_fake
def _kv_write_fake(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Shape/device checks only: what FakeTensorMode, compile and graph capture rely on."""
    check_kv_write_args(k, v, k_cache, v_cache, slot_mapping)
