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
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + row * stride_vn + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


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
    if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from k/v dtype {k.dtype}")
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
