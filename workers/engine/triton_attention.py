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

import torch

from workers.engine.attention import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionParams,
    BatchLayout,
    PagedMetadata,
    StepMetadata,
    paged_metadata,
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

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> PagedMetadata:
        """The shared paged metadata: all the kernels read, copied without a host sync."""
        return paged_metadata(layout, device)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k/v into the pool in one kernel launch."""
        kv_write(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, metadata: StepMetadata,
               params: AttentionParams = FULL_ATTENTION) -> torch.Tensor:
        """Attend q over pool and chunk in one launch."""
        meta = metadata
        assert isinstance(meta, PagedMetadata)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        paged_attention(
            q, k, v, k_cache, v_cache, out,
            meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
            self.scale_of(params), meta.max_query_len,
            params.sliding_window or 0, params.softcap or 0.0,
        )  # fmt: skip
        return out.view(q.shape[0], self.num_heads * self.head_dim)
