"""Paged attention for a mixed batch (prefill chunks and decodes) as one Triton kernel.

Tensors (one CUDA device, or CPU under TRITON_INTERPRET=1); N new tokens, S sequences:
- q: (N, H, D); k, v: (N, Hkv, D) — this step's tokens packed sequence after sequence,
  any strides with a contiguous last dimension (views of the fused qkv output);
- k_cache, v_cache: (num_blocks, block_size, Hkv, D) contiguous, q's dtype;
  block_size a power of two (>= 16 on GPUs: `tl.dot` tiles need 16 rows);
- out: (N, H, D), q's dtype, written in full;
- cu_seqlens_q: (S + 1,) int32, rows of sequence s are cu_seqlens_q[s]:cu_seqlens_q[s + 1];
- seq_lens: (S,) int32, tokens of s after this step (cached + new);
- block_tables: (S, W) int32, row-contiguous; only the first
  ceil((seq_len - query_len) / block_size) entries of a row are read.

Grid: (S, Hkv, ceil(max_query_len / BLOCK_Q)). A program takes BLOCK_Q query tokens of one
sequence times the GROUP = H / Hkv query heads sharing one KV head: BLOCK_M >= BLOCK_Q *
GROUP rows (16 at least, for `tl.dot`), so GQA reads each K/V tile once for its group.
It first walks the cached prefix page by page through the block table (every cached key
is visible to every query), then the chunk's own keys straight from k/v, causally. A
prefill with nothing cached therefore never touches the pool or the block table, and the
KV write may run before or after this kernel. Softmax is online, in fp32, base 2.

Sliding window (`window` > 0): a query at position p sees keys p - window + 1 .. p; the
walks start at the first block (tile) any query of the program can see, and keys before a
row's window score -1e30 rather than -inf, so a row whose whole first tile lies before its
window keeps a finite running max (its weights there are wiped by the next tile's alpha).
Soft-capping (`softcap` > 0): scores -> softcap * tanh(scores / softcap) before the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.kernels.interpreter import dot_options
from workers.engine.kv_dtypes import FP8_KV


@triton.jit
def _softmax_step(m, den, acc, scores, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores (M, n) and values (n, Dp) into the running (m, den, acc)."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    den = den * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, den, acc


@triton.jit
def _scores(q, k, scale, softcap, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Scores of a tile in base-2 units: (q k^T) * scale, soft-capped, times log2(e)."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    if HAS_SOFTCAP:  # tanh(x) = 2 sigmoid(2 x) - 1
        scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
    return scores * 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    scale, window, softcap,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.program_id(2) * BLOCK_Q
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if first >= q_len:  # a shorter sequence than the batch's longest: no tile here
        return
    num_cached = tl.load(seq_lens_ptr + seq) - q_len

    # Row r is query token first + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    tok = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_offs = (q_start + tok)[:, None] * stride_qn + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)

    # The cached prefix, one pool block per iteration. Every row sees at least key 0 of the
    # first tile it meets, so m is finite after it and exp2(m - m_new) never makes a NaN.
    slots = tl.arange(0, BLOCK_SIZE)
    pos = num_cached + tok  # each row's query position
    first_key = 0
    if HAS_WINDOW:  # the first key the program's first query sees
        first_key = tl.maximum(num_cached + first - window + 1, 0)
    for j in range(first_key // BLOCK_SIZE, tl.cdiv(num_cached, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_table + j).to(tl.int64)
        key_ok = j * BLOCK_SIZE + slots < num_cached
        offs = block * stride_cache_block + slots[:, None] * stride_cache_slot
        offs += kv_head * stride_cache_head + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        # An fp8 pool's rows widen to q's dtype here; otherwise a no-op or the upcast.
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
        scores = _scores(q, k, scale, softcap, DOT_PRECISION, HAS_SOFTCAP)
        if HAS_WINDOW:
            seen = j * BLOCK_SIZE + slots[None, :] > pos[:, None] - window
            scores = tl.where(seen, scores, -1e30)
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m, den, acc = _softmax_step(m, den, acc, scores, v, DOT_PRECISION)

    # The chunk's own keys, from k/v: key i sits at position num_cached + i, and query
    # token t sees keys 0..t. The tile's last query is the last key it needs.
    last = tl.minimum(q_len, first + BLOCK_Q)
    cols = tl.arange(0, BLOCK_N)
    first_new = 0
    if HAS_WINDOW:  # tiles wholly before the first query's window are skipped
        first_new = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    for i in range(first_new, last, BLOCK_N):
        idx = i + cols
        key_ok = idx < last
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_ptr + (q_start + idx)[:, None] * stride_kn + kv_head * stride_kh + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr + (q_start + idx)[:, None] * stride_vn + kv_head * stride_vh + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = _scores(q, k, scale, softcap, DOT_PRECISION, HAS_SOFTCAP)
        if HAS_WINDOW:
            scores = tl.where(idx[None, :] > tok[:, None] - window, scores, -1e30)
        scores = tl.where(key_ok[None, :] & (idx[None, :] <= tok[:, None]), scores, float("-inf"))
        m, den, acc = _softmax_step(m, den, acc, scores, v, DOT_PRECISION)

    out = acc / den[:, None]
    o_offs = (q_start + tok)[:, None] * stride_on + head[:, None] * stride_oh + dims[None, :]
    o_mask = row_ok[:, None] & dim_ok[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


def check_paged_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    """Raise ValueError for arguments the kernel would silently misread."""
    tensors = {
        "q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "out": out,
        "cu_seqlens_q": cu_seqlens_q, "seq_lens": seq_lens, "block_tables": block_tables,
    }  # fmt: skip
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"paged_attention tensors must share one device, got {devices}")
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0]:
        raise ValueError(f"q must be (N, H, D) and k/v (N, Hkv, D): {q.shape}, {k.shape}")
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"query heads must be a multiple of KV heads: {q.shape}, {k.shape}")
    if any(t.stride(-1) != 1 for t in (q, k, v, out)) or out.shape != q.shape:
        raise ValueError("q, k, v and out need a contiguous last dim; out must be q's shape")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not hold rows {tuple(k.shape[1:])}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if len({q.dtype, k.dtype, v.dtype, out.dtype}) != 1:
        raise ValueError("q, k, v and out must share one dtype")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8_KV):
        raise ValueError(f"the caches must be {q.dtype} or {FP8_KV}, got {k_cache.dtype}")
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("cu_seqlens_q needs S + 1 entries and block_tables S rows")
    if any(t.dtype != torch.int32 for t in (cu_seqlens_q, seq_lens, block_tables)):
        raise ValueError("cu_seqlens_q, seq_lens and block_tables must be int32")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")


@torch.library.custom_op("batchinfer::paged_attention", mutates_args=("out",))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Write into out (N, H, D) the causal paged attention of q; see the module docstring.

    max_query_len bounds every sequence's new tokens (1 for a decode-only step): it sizes
    the grid and is the one value the host must know, so a graph captured with 1 replays
    for any context length.
    """
    check_paged_attention_args(q, k, v, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return
    group = q.shape[1] // k.shape[1]
    head_dim = q.shape[2]
    # Decodes: one token per program, the group's heads as rows. Longer chunks: 64+ rows.
    block_m = max(16, triton.next_power_of_2(group), 1 if max_query_len == 1 else 64)
    block_q = 1 if max_query_len == 1 else block_m // group
    # The interpreter's bf16 arithmetic and tl.dot are wrong (triton-lang/triton#4972):
    # there bf16 tiles are loaded as bf16 and computed in fp32. fp32 dots stay exact (no
    # TF32) so fp32 runs match the torch path.
    upcast, precision = dot_options(q.dtype)
    grid = (num_seqs, k.shape[1], triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        q, k, v, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables,
        scale, window, softcap,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=32,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        HAS_WINDOW=window > 0,
        HAS_SOFTCAP=softcap > 0,
    )  # fmt: skip


@paged_attention.register_fake
def _paged_attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Shape/device checks only: what FakeTensorMode, compile and graph capture rely on."""
    check_paged_attention_args(q, k, v, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables)
