"""flash-attn's two Python entry points, computed with torch on any device.

The stand-ins check their arguments as flash-attn 2 does (half dtypes, contiguous last
dimension, int32 lengths and tables, paged blocks of a multiple of 256, head sizes,
one device) and then compute bottom-right-aligned causal attention densely in fp32.
`flash_attn_with_kvcache` never leaves the device, so it can sit inside a captured graph.
`install(monkeypatch)` puts them where workers.engine.flash_attention looks for them.
"""

from __future__ import annotations

import pytest
import torch

import workers.engine.flash_attention as flash_module


class FlashArgumentError(RuntimeError):
    """What flash-attn raises (as RuntimeError) for arguments its kernels cannot take."""


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise FlashArgumentError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise FlashArgumentError("query and key must have the same dtype")
    if len({q.device, k.device, v.device}) != 1:
        raise FlashArgumentError("Input tensors must be on the same device")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise FlashArgumentError("Input tensor must have contiguous last dimension")
    head_dim = q.shape[-1]
    if head_dim > 256 or head_dim % 8 or k.shape[-1] != head_dim:
        raise FlashArgumentError("FlashAttention forward only supports head dimension at most 256")
    if q.shape[-2] % k.shape[-2]:
        raise FlashArgumentError("Number of heads in key/value must divide heads in query")


def _check_int32(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype != torch.int32:
            raise FlashArgumentError(f"{name} must have dtype int32")


def _check_paged(k_cache: torch.Tensor, block_table: torch.Tensor) -> None:
    _check_int32(block_table=block_table)
    if block_table.stride(-1) != 1:
        raise FlashArgumentError("block_table must have contiguous last dimension")
    if k_cache.shape[1] % 256:
        raise FlashArgumentError("Paged KV cache block size must be divisible by 256")


def _windowed(valid: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor,
              window_size: tuple[int, int]) -> torch.Tensor:
    """flash-attn's local attention: keys from query_pos - left to query_pos + right."""
    left, right = window_size
    if left >= 0:
        valid = valid & (key_pos >= query_pos - left)
    if right >= 0:
        valid = valid & (key_pos <= query_pos + right)
    return valid


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q (B, n, H, D) over k/v (B, L, Hkv, D); valid (B, n, L) bool -> (B, n, H, D) fp32."""
    group = q.shape[2] // k.shape[2]
    k = k.float().repeat_interleave(group, dim=2)
    v = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bnhd,blhd->bhnl", q.float(), k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    return torch.einsum("bhnl,blhd->bnhd", scores.softmax(-1), v)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """q (B, n, H, D) over each row's first cache_seqlens[b] paged keys; sync-free."""
    _check(q, k_cache, v_cache)
    _check_int32(cache_seqlens=cache_seqlens)
    _check_paged(k_cache, block_table)
    batch, n = q.shape[0], q.shape[1]
    # (B, W * block_size, Hkv, D): every table entry's block, in order.
    keys = k_cache[block_table.long()].flatten(1, 2)
    values = v_cache[block_table.long()].flatten(1, 2)
    positions = torch.arange(keys.shape[1], device=q.device)
    # Query j of row b sits at cache_seqlens[b] - n + j (bottom-right causal alignment).
    query_pos = cache_seqlens[:, None].long() - n + torch.arange(n, device=q.device)[None, :]
    valid = positions[None, None, :] < cache_seqlens[:, None, None]
    if causal:
        valid = valid & (positions[None, None, :] <= query_pos[:, :, None])
    valid = _windowed(valid, positions[None, None, :], query_pos[:, :, None], window_size)
    out = _attend(q, keys, values, valid, softmax_scale, softcap)
    return out.to(q.dtype).view(batch, n, *q.shape[2:])


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    block_table: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """Packed q (N, H, D) over packed k/v (Nk, Hkv, D), or paged k/v with block_table."""
    _check(q, k, v)
    _check_int32(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if block_table is not None:
        _check_paged(k, block_table)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        q_start, q_end = bounds_q[b], bounds_q[b + 1]
        num_keys = bounds_k[b + 1] - bounds_k[b]
        if q_end - q_start > max_seqlen_q or num_keys > max_seqlen_k:
            raise FlashArgumentError("max_seqlen_q / max_seqlen_k smaller than a sequence")
        if block_table is None:
            keys, values = k[bounds_k[b] : bounds_k[b + 1]], v[bounds_k[b] : bounds_k[b + 1]]
        else:
            table = block_table[b].long()
            keys = k[table].flatten(0, 1)[:num_keys]
            values = v[table].flatten(0, 1)[:num_keys]
        n = q_end - q_start
        query_pos = num_keys - n + torch.arange(n, device=q.device)
        key_pos = torch.arange(num_keys, device=q.device)[None, :]
        valid = key_pos <= query_pos[:, None]
        if not causal:
            valid = torch.ones_like(valid)
        valid = _windowed(valid, key_pos, query_pos[:, None], window_size)
        o = _attend(q[None, q_start:q_end], keys[None], values[None], valid[None], softmax_scale,
                    softcap)
        out[q_start:q_end] = o[0].to(q.dtype)
    return out


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let FlashAttentionBackend call the stand-ins, as if flash-attn were installed."""
    monkeypatch.setattr(flash_module, "HAS_FLASH_ATTN", True)
    for fn in (flash_attn_with_kvcache, flash_attn_varlen_func):
        monkeypatch.setattr(flash_module, fn.__name__, fn, raising=False)
