"""Plain torch definitions of what the Triton kernels compute: the spec they are tested on.

Shapes as in the kernels: q (N, H, D) and k/v (N, Hkv, D) are the step's new tokens,
packed sequence after sequence; the pool per layer is (num_blocks, block_size, Hkv, D);
`cu_seqlens_q` (S + 1,) gives each sequence's rows, `seq_lens` (S,) its tokens after this
step, `block_tables` (S, max_blocks) its pool blocks.
"""

from __future__ import annotations

import torch

from workers.engine.kv_dtypes import FP8_KV, FP8_KV_MAX


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Row i of k/v goes to pool slot slot_mapping[i] (= block * block_size + offset); an
    fp8 pool stores it clamped to fp8's finite range, then rounded."""
    hkv, d = k.shape[1], k.shape[2]
    if k_cache.dtype == FP8_KV:
        k, v = k.float().clamp(-FP8_KV_MAX, FP8_KV_MAX), v.float().clamp(-FP8_KV_MAX, FP8_KV_MAX)
    k_cache.view(-1, hkv, d)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, hkv, d)[slot_mapping] = v.to(v_cache.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its cached prefix plus its new keys.

    window > 0: a query at position p sees only keys p - window + 1 .. p; softcap > 0:
    scores become softcap * tanh(scores / softcap) before the softmax.

    The cached prefix (seq_len - query_len tokens) is read from the pool through the block
    table; the new keys come from k/v, not from the pool. Returns (N, H, D) in fp32.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens_q.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = bounds[s], bounds[s + 1]
        num_new = end - start
        num_cached = seq_len - num_new
        blocks = block_tables[s, : -(-num_cached // block_size)].long()
        # (num_cached, Hkv, D) from the pool, then the new keys: (seq_len, Hkv, D)
        cached_k = k_cache[blocks].flatten(0, 1)[:num_cached].to(k.dtype)  # an fp8 pool: widened
        cached_v = v_cache[blocks].flatten(0, 1)[:num_cached].to(v.dtype)
        keys = torch.cat([cached_k, k[start:end]]).float().repeat_interleave(group, dim=1)
        values = torch.cat([cached_v, v[start:end]]).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[start:end].float(), keys) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        query_pos = (num_cached + torch.arange(num_new, device=q.device))[:, None]
        allowed = key_pos <= query_pos
        if window > 0:
            allowed &= key_pos > query_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:end] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values)
    return out
