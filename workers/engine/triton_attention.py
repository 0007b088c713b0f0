"""Triton backend: paged attention on CUDA with nothing beyond torch's own CUDA wheel.

Mixed steps and decode-only steps run the same two kernels (workers/engine/kernels/): one
KV write, then one paged attention launch per layer, whatever the mix of prefill chunks and
decodes. All inputs are device tensors of fixed shape for a given batch size, and the only
host value the kernels need (the longest query) is 1 for decodes, so decode steps can be
captured in CUDA graphs. Rows may come in any order; masks come from `seq_lens` on the
device, inside the kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from workers.engine.attention import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionParams,
    BatchLayout,
    to_device,
)

logger = logging.getLogger(__name__)

try:  # Triton ships with torch's CUDA wheels; the CPU wheel lacks it.
    from workers.engine.kernels.kv_write import kv_write
    from workers.engine.kernels.paged_attention import paged_attention

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# tl.dot needs tiles of at least 16 rows: pool blocks are key tiles of the kernel.
MIN_TRITON_BLOCK_SIZE = 16


@dataclass(slots=True)
class TritonAttentionMetadata:
    """Device tensors the kernels read for one step, shared by every layer."""

    slot_mapping: torch.Tensor  # (N,) int64
    cu_seqlens_q: torch.Tensor  # (S + 1,) int32
    seq_lens: torch.Tensor  # (S,) int32: cached + new tokens
    block_tables: torch.Tensor  # (S, W) int32, padded with block 0 (never read)
    max_query_len: int  # 1 for decode-only steps, the only host value a launch needs


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with this project's Triton kernels (CUDA; fp32, fp16, bf16)."""

    name = "triton"
    default_block_size = 16
    supports_cuda_graphs = True

    def check_block_size(self, block_size: int) -> None:
        """Pool blocks are kernel tiles: a power of two of at least 16 tokens."""
        if block_size < MIN_TRITON_BLOCK_SIZE or block_size & (block_size - 1):
            raise ValueError(
                f"block_size must be a power of two >= {MIN_TRITON_BLOCK_SIZE} with the triton "
                f"attention backend, got {block_size}"
            )

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> TritonAttentionMetadata:
        """Cumulative query lengths, lengths and a padded table, copied without a host sync."""
        width = max(len(t) for t in layout.block_tables)
        tables = [t + [0] * (width - len(t)) for t in layout.block_tables]
        cu_seqlens_q = [0]
        for n in layout.query_lens:
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
        # One host tensor and one copy for the three int32 vectors.
        num_seqs = len(layout.seq_lens)
        packed = torch.tensor(cu_seqlens_q + layout.seq_lens, dtype=torch.int32)
        packed = to_device(packed, device)
        return TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            cu_seqlens_q=packed[: num_seqs + 1],
            seq_lens=packed[num_seqs + 1 :],
            block_tables=to_device(torch.tensor(tables, dtype=torch.int32), device),
            max_query_len=max(layout.query_lens),
        )

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
    ) -> TritonAttentionMetadata:
        """Metadata over fixed buffers, for capturing and replaying decode CUDA graphs."""
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens,
            block_tables=block_tables,
            max_query_len=1,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        params: AttentionParams = FULL_ATTENTION,
    ) -> torch.Tensor:
        """Store k/v into the pool (one launch), attend q over pool and chunk (one launch)."""
        assert isinstance(metadata, TritonAttentionMetadata)
        meta = metadata
        kv_write(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        paged_attention(
            q, k, v, k_cache, v_cache, out,
            meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
            self.scale_of(params), meta.max_query_len,
            params.sliding_window or 0, params.softcap or 0.0,
        )  # fmt: skip
        return out.view(q.shape[0], self.num_heads * self.head_dim)
