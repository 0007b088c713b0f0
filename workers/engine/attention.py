"""Attention over the paged KV cache: the backend interface and the pure-torch backend.

The torch backend runs anywhere and is tuned for the CPU; on CUDA the Triton backend
(triton_attention.py) or flash-attn (flash_attention.py) take over. Each backend is
responsible for two things per layer: writing this step's new K/V into the pool (one
vectorised op, never a loop over tokens) and attending every query to the cached
positions of its own sequence, causally.

Pool layout per layer, shared by all backends (it is flash-attn's paged layout):
`(num_blocks, block_size, num_kv_heads, head_dim)`. Token position p of a sequence lives in
slot `block_table[p // block_size] * block_size + p % block_size`; e.g. with block_size 16
and block_table [7, 2], position 20 is slot 2 * 16 + 4 = 36.

Every backend's forward is the same two steps, written once here: store this step's K/V
(`write_kv`: a torch scatter, or a backend's own kernel), then `attend`, the one method
each backend must write. The paged backends (CPU, Triton, flash-attn) read the same step
metadata (`PagedMetadata`: slots, padded block tables, lengths, query offsets), built once
per step by `paged_metadata`; each adds only what its kernels need beyond it.

Rows of a batch arrive ordered by the model runner: single-query sequences ("decodes",
though a one-token prefill chunk counts too) first, by ascending sequence length, then the
longer chunks. The torch backend relies on that order to batch decodes with little padding.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from workers.engine.kv_dtypes import FP8_KV, FP8_KV_MAX
from workers.engine.pointwise import TORCH_POINTWISE, TorchPointwise

logger = logging.getLogger(__name__)

# A new decode group starts when a sequence needs more than this many times the blocks of
# the group's shortest one. Padding costs more than extra calls on CPU: at batch 64 with
# contexts of 32..768 tokens, a SmolLM2-135M decode step takes 25% less CPU time with 1.05
# (about 26 groups) than with 1.5 (6 groups); 1.0 is again slightly slower.
_DECODE_GROUP_GROWTH = 1.05


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """What one layer's attention asks of the backend beyond q, k and v."""

    scale: float | None = None  # None: head_dim ** -0.5
    # A query at position p sees keys p - sliding_window + 1 .. p (Hugging Face's
    # `kv_idx > q_idx - sliding_window`); None: every earlier key.
    sliding_window: int | None = None
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)


FULL_ATTENTION = AttentionParams()


@dataclass(slots=True)
class BatchLayout:
    """Host-side description of one step, from which each backend builds its metadata."""

    query_lens: list[int]  # new tokens per sequence this step
    seq_lens: list[int]  # tokens in the cache after this step (cached + new)
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # (num_tokens,) int64 on the device
    num_decodes: int  # leading sequences whose query length is 1
    block_size: int
    dtype: torch.dtype = torch.float32  # of q/k/v: additive masks are built in it
    # block_tables as one (S, W) int32 host tensor, each row padded past its table's end
    # with entries never read: the model runner keeps these rows from step to step. None:
    # padded from block_tables when a backend needs it.
    block_table_tensor: torch.Tensor | None = None


@dataclass(slots=True)
class StepMetadata:
    """What every backend's forward reads: the pool slot of each new K/V row."""

    slot_mapping: torch.Tensor  # (N,) int64


@dataclass(slots=True)
class PagedMetadata(StepMetadata):
    """Device tensors the paged kernels read for one step, shared by every layer."""

    block_tables: torch.Tensor  # (S, W) int32, padded with entries never read
    seq_lens: torch.Tensor  # (S,) int32: cached + new tokens
    cu_seqlens_q: torch.Tensor  # (S + 1,) int32: query offsets, 0 first
    max_query_len: int  # 1 for decode-only steps
    max_seq_len: int  # 0 where unknown (graph replays)


def padded_block_tables(tables: list[list[int]], pad: int = 0) -> torch.Tensor:
    """(S, W) int32 host tensor of the tables, each padded with `pad` to the longest."""
    width = max((len(t) for t in tables), default=0)
    out = np.full((len(tables), width), pad, dtype=np.int32)
    for row, table in zip(out, tables, strict=True):
        row[: len(table)] = table
    return torch.from_numpy(out)


def paged_metadata(layout: BatchLayout, device: torch.device) -> PagedMetadata:
    """The step's paged metadata on `device`: two host-to-device copies, no host sync."""
    tables = layout.block_table_tensor
    if tables is None:
        tables = padded_block_tables(layout.block_tables)
    num_seqs = len(layout.seq_lens)
    cu_seqlens_q = list(itertools.accumulate(layout.query_lens, initial=0))
    # One host tensor and one copy for the two int32 vectors.
    values = array("i", cu_seqlens_q + layout.seq_lens)  # ~10x cheaper than torch.tensor()
    packed = to_device(torch.frombuffer(values, dtype=torch.int32), device)
    return PagedMetadata(
        slot_mapping=layout.slot_mapping,
        block_tables=to_device(tables, device),
        seq_lens=packed[num_seqs + 1 :],
        cu_seqlens_q=packed[: num_seqs + 1],
        max_query_len=max(layout.query_lens),
        max_seq_len=max(layout.seq_lens),
    )


class AttentionBackend(ABC):
    """Writes new K/V into the pool and computes paged causal attention.

    A backend writes `build_metadata` and `attend`; `forward` and `write_kv` are shared.
    """

    name: str
    default_block_size: int
    supports_cuda_graphs: bool = False
    # Whether build_metadata reads BatchLayout.block_table_tensor (the paged backends).
    reads_block_table_tensor: bool = True
    # The model's pointwise steps on this backend's device (workers/engine/pointwise.py).
    pointwise: TorchPointwise = TORCH_POINTWISE

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def scale_of(self, params: AttentionParams) -> float:
        """The layer's softmax scale: its own, else head_dim ** -0.5."""
        return self.scale if params.scale is None else params.scale

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError naming block_size when this backend cannot page with it."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
    ) -> StepMetadata:
        """Metadata over fixed decode buffers, for backends that support CUDA graphs.

        slot_mapping (B,) int64, seq_lens (B,) int32, block_tables (B, W) int32 and
        cu_seqlens_q (B + 1,) int32 = 0..B: their contents change between replays, never
        their addresses.
        """
        if not self.supports_cuda_graphs:
            raise NotImplementedError(
                f"the {self.name} attention backend has no CUDA-graph path"
            )
        return PagedMetadata(slot_mapping, block_tables, seq_lens, cu_seqlens_q,
                             max_query_len=1, max_seq_len=0)

    def pool_workspace_ratio(self, num_layers: int) -> float:
        """Bytes of gather workspace a step may need per byte of KV pool (0: reads in place)."""
        return 0.0

    def mask_bytes(self, max_num_batched_tokens: int, max_model_len: int, itemsize: int) -> int:
        """Most bytes of attention masks one step can hold (0: masks live in the kernel)."""
        return 0

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, device: torch.device) -> StepMetadata:
        """Turn the step's layout into the tensors forward() needs, once for all layers."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: object,
                params: AttentionParams = FULL_ATTENTION) -> torch.Tensor:
        """Store k/v, attend q; q (N, H, D), k/v (N, Hkv, D) -> (N, H * D)."""
        assert isinstance(metadata, StepMetadata)
        self.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return self.attend(q, k, v, k_cache, v_cache, metadata, params)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's K/V rows in their pool slots (a torch scatter by default)."""
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, metadata: StepMetadata,
               params: AttentionParams = FULL_ATTENTION) -> torch.Tensor:
        """Attend q once this step's K/V are in the pool; (N, H, D) -> (N, H * D)."""


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's K/V rows (N, Hkv, D) into their pool slots in one op each."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k, v = to_pool(k, k_cache.dtype), to_pool(v, v_cache.dtype)
    if k_cache.dtype == FP8_KV:  # the CPU has no fp8 index_copy_: the same bytes as uint8
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    # (num_blocks, block_size, Hkv, D) -> (num_slots, Hkv, D): a view, the pool is contiguous.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def to_pool(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """K/V rows in the pool's dtype: as they are, or clamped to fp8's finite range and
    rounded (out of range, a cast could give NaN on some devices)."""
    if x.dtype == pool_dtype:
        return x
    if pool_dtype == FP8_KV:
        x = x.clamp(-FP8_KV_MAX, FP8_KV_MAX)
    return x.to(pool_dtype)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to `device`; pinned first on CUDA so the copy does not block the host."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(slots=True)
class _DecodeGroup:
    start: int  # first row of the group in the batch
    end: int
    offset: int  # first workspace block of the group
    num_blocks: int  # blocks per sequence, padded to the longest in the group
    mask: torch.Tensor  # (rows, 1, 1, num_blocks * block_size) additive: 0 or -inf
    seq_lens: torch.Tensor  # (rows,) on the device: the windowed masks are built from it


@dataclass(slots=True)
class _Chunk:
    start: int
    end: int
    offset: int | None  # first workspace block; None: nothing cached, attend to the chunk
    seq_len: int
    mask: torch.Tensor | None  # (n, seq_len) additive causal mask, offset by the cached length


@dataclass(slots=True)
class TorchAttentionMetadata(StepMetadata):
    """What the torch backend needs for one step, shared by every layer."""

    # Pool blocks each layer gathers, part by part: each decode group's tables (padded
    # with block 0), then each cached chunk's table. (num_gather_blocks,) int64
    gather_block_ids: torch.Tensor
    max_part_blocks: int = 0  # the largest part: the workspace every part reuses
    decode_groups: list[_DecodeGroup] = field(default_factory=list)
    chunks: list[_Chunk] = field(default_factory=list)
    dtype: torch.dtype = torch.float32
    # Sliding-window masks, built on first use by a windowed layer and shared by the rest:
    # (window, "group" or "chunk", index) -> additive mask shaped like the full one.
    window_masks: dict[tuple[int, str, int], torch.Tensor] = field(default_factory=dict)


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with torch's SDPA; any device, any block size, fp32 included.

    Decodes are attended in batched SDPA calls, grouped by length; longer chunks one
    sequence at a time. Each group's (or chunk's) blocks are gathered just before its call
    into one reusable workspace: it stays in cache between the copy and the attention
    (about 20% faster per decode step than one gather per layer), and fresh allocations of
    tens of MB per layer would cost more than the copy itself on CPU.
    """

    name = "torch"
    default_block_size = 16
    reads_block_table_tensor = False  # gathers through block_tables lists

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self._k_workspace: torch.Tensor | None = None
        self._v_workspace: torch.Tensor | None = None

    def pool_workspace_ratio(self, num_layers: int) -> float:
        """A decode group gathers up to one layer's K and V, padded by the group growth."""
        return _DECODE_GROUP_GROWTH / num_layers

    def mask_bytes(self, max_num_batched_tokens: int, max_model_len: int, itemsize: int) -> int:
        """Every query row of a step has at most max_model_len keys in its mask (an 8k-token
        chunk over 32k of context: 512 MB in bf16)."""
        return max_num_batched_tokens * max_model_len * itemsize

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TorchAttentionMetadata:
        """Group decodes by length, describe each longer chunk, list the blocks to gather.

        Masks are built on the device from the step's lengths: the host sends one small
        vector of lengths, not (rows, keys) matrices.
        """
        block_size = layout.block_size
        seq_lens_dev: torch.Tensor | None = None
        meta = TorchAttentionMetadata(
            layout.slot_mapping, torch.empty(0, dtype=torch.int64), dtype=layout.dtype
        )
        seq_nblocks = [-(-n // block_size) for n in layout.seq_lens]
        gather: list[int] = []
        start = 0
        while start < layout.num_decodes:
            end = start + 1
            limit = seq_nblocks[start] * _DECODE_GROUP_GROWTH
            while end < layout.num_decodes and seq_nblocks[end] <= limit:
                end += 1
            num_blocks = seq_nblocks[end - 1]  # rows are sorted by length: the last is longest
            offset = len(gather)
            for i in range(start, end):
                gather += layout.block_tables[i][: seq_nblocks[i]]
                gather += [0] * (num_blocks - seq_nblocks[i])
            if seq_lens_dev is None:
                decode_lens = torch.tensor(layout.seq_lens[: layout.num_decodes])
                seq_lens_dev = to_device(decode_lens, device)
            keys = torch.arange(num_blocks * block_size, device=device)
            allowed = keys[None, :] < seq_lens_dev[start:end, None]
            mask = _additive(allowed, layout.dtype)[:, None, None, :]
            meta.decode_groups.append(
                _DecodeGroup(start, end, offset, num_blocks, mask, seq_lens_dev[start:end])
            )
            meta.max_part_blocks = max(meta.max_part_blocks, len(gather) - offset)
            start = end
        row = layout.num_decodes
        for i in range(layout.num_decodes, len(layout.query_lens)):
            n, seq_len = layout.query_lens[i], layout.seq_lens[i]
            chunk = _Chunk(start=row, end=row + n, offset=None, seq_len=seq_len, mask=None)
            if seq_len > n:  # part of the context is only in the pool
                num_cached = seq_len - n
                chunk.offset = len(gather)
                gather += layout.block_tables[i][: seq_nblocks[i]]
                # Query j sits at position num_cached + j and sees keys 0..num_cached + j.
                keys = torch.arange(seq_len, device=device)
                queries = torch.arange(num_cached, seq_len, device=device)
                chunk.mask = _additive(keys[None, :] <= queries[:, None], layout.dtype)
                meta.max_part_blocks = max(meta.max_part_blocks, seq_nblocks[i])
            meta.chunks.append(chunk)
            row += n
        if gather:
            meta.gather_block_ids = to_device(torch.tensor(gather, dtype=torch.int64), device)
        return meta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, metadata: StepMetadata,
               params: AttentionParams = FULL_ATTENTION) -> torch.Tensor:
        """Attend decodes in groups and longer chunks one by one; rows as in `metadata`."""
        meta = metadata
        assert isinstance(meta, TorchAttentionMetadata)
        hkv, d = self.num_kv_heads, self.head_dim
        scale, window, cap = self.scale_of(params), params.sliding_window, params.softcap
        group = self.num_heads // hkv
        k_buf, v_buf = self._workspaces(k_cache, meta.max_part_blocks)
        ids = meta.gather_block_ids
        parts: list[torch.Tensor] = []  # (rows, H * D) each, in row order
        for i, g in enumerate(meta.decode_groups):
            rows = g.end - g.start
            part = ids[g.offset : g.offset + rows * g.num_blocks]
            # (rows * nb, block_size, Hkv, D) -> (rows, Hkv, nb * block_size, D), strided view.
            kg = torch.index_select(k_cache, 0, part, out=k_buf[: part.numel()]).to(q.dtype)
            vg = torch.index_select(v_cache, 0, part, out=v_buf[: part.numel()]).to(q.dtype)
            kg = kg.view(rows, -1, hkv, d).transpose(1, 2)
            vg = vg.view(rows, -1, hkv, d).transpose(1, 2)
            # One query per row: its query heads of one KV head act as `group` query rows of
            # that head, so GQA needs no repeated K/V. (rows, Hkv, group, D)
            qg = q[g.start : g.end].view(rows, hkv, group, d)
            mask = g.mask if window is None else _group_window_mask(meta, i, window)
            o = _attention(qg, kg, vg, mask, scale, cap, group=1)
            parts.append(o.view(rows, self.num_heads * d))
        for j, c in enumerate(meta.chunks):
            qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
            if c.offset is None:
                kc = k[c.start : c.end].transpose(0, 1).unsqueeze(0)  # (1, Hkv, n, D)
                vc = v[c.start : c.end].transpose(0, 1).unsqueeze(0)
                if window is None and cap is None:
                    o = F.scaled_dot_product_attention(
                        qc, kc, vc, is_causal=True, scale=scale, enable_gqa=group > 1
                    )
                else:
                    o = _attention(qc, kc, vc, _chunk_mask(meta, j, c, window), scale, cap, group)
            else:
                part = ids[c.offset : c.offset + -(-c.seq_len // k_cache.shape[1])]
                kc = torch.index_select(k_cache, 0, part, out=k_buf[: part.numel()]).to(q.dtype)
                vc = torch.index_select(v_cache, 0, part, out=v_buf[: part.numel()]).to(q.dtype)
                kc = kc.view(-1, hkv, d)[: c.seq_len].transpose(0, 1).unsqueeze(0)
                vc = vc.view(-1, hkv, d)[: c.seq_len].transpose(0, 1).unsqueeze(0)
                cmask = c.mask if window is None else _chunk_mask(meta, j, c, window)
                o = _attention(qc, kc, vc, cmask, scale, cap, group)
            parts.append(o[0].transpose(0, 1).reshape(c.end - c.start, self.num_heads * d))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _workspaces(
        self, cache: torch.Tensor, num_blocks: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Grow-only gather buffers shaped like `num_blocks` pool blocks."""
        ws = self._k_workspace
        if (
            ws is None
            or ws.shape[0] < num_blocks
            or ws.shape[1:] != cache.shape[1:]
            or ws.dtype != cache.dtype
            or ws.device != cache.device
        ):
            size = max(num_blocks, 1)
            self._k_workspace = cache.new_empty(size, *cache.shape[1:])
            self._v_workspace = cache.new_empty(size, *cache.shape[1:])
        assert self._k_workspace is not None and self._v_workspace is not None
        return self._k_workspace, self._v_workspace


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> 0 / -inf in q's dtype, built once per step instead of by SDPA per layer."""
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return zeros.masked_fill_(~allowed, float("-inf"))


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    group: int,
) -> torch.Tensor:
    """SDPA with an additive mask, or, with soft-capping (which SDPA cannot do), the same
    in plain ops as Hugging Face's eager attention computes it. q (..., H, n, D), k/v
    (..., H / group, keys, D), mask broadcastable to (..., H, n, keys)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1
        )
    if group > 1:  # each KV head once per query head of its group
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def _group_window_mask(meta: TorchAttentionMetadata, index: int, window: int) -> torch.Tensor:
    """A decode group's mask with only each row's last `window` keys allowed."""
    key = (window, "group", index)
    mask = meta.window_masks.get(key)
    if mask is None:
        g = meta.decode_groups[index]
        keys = torch.arange(g.mask.shape[-1], device=g.mask.device)
        lens = g.seq_lens[:, None]
        allowed = (keys[None, :] < lens) & (keys[None, :] >= lens - window)
        mask = meta.window_masks[key] = _additive(allowed, meta.dtype)[:, None, None, :]
    return mask


def _chunk_mask(
    meta: TorchAttentionMetadata, index: int, c: _Chunk, window: int | None
) -> torch.Tensor:
    """A chunk's causal mask over its seq_len keys, windowed when `window` is set."""
    key = (window or 0, "chunk", index)
    mask = meta.window_masks.get(key)
    if mask is None:
        n = c.end - c.start
        device = meta.slot_mapping.device
        keys = torch.arange(c.seq_len, device=device)[None, :]
        queries = torch.arange(c.seq_len - n, c.seq_len, device=device)[:, None]
        allowed = keys <= queries
        if window is not None:
            allowed &= keys > queries - window
        mask = meta.window_masks[key] = _additive(allowed, meta.dtype)
    return mask
