"""CPU backend: decodes and prefill chunks read the paged pool in place through C++ kernels.

The torch backend gathers each decode group's blocks into a workspace and runs one SDPA
call per group and layer (about 20 groups at batch 64), and one per prefill chunk; on a
SmolLM2-135M decode step that was a third of the step. Here all decode rows of a layer are
one call of `torch.ops.batchinfer_cpu.paged_decode_attention` and all chunk rows one call
of `paged_prefill_attention` (kernels/cpu_paged_attention.cpp), which walk each sequence's
block table and never copy K/V. Head sizes the prefill kernel is not compiled for run their
chunks through the torch backend, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.attention import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionParams,
    BatchLayout,
    StepMetadata,
    TorchAttentionBackend,
    TorchAttentionMetadata,
    paged_metadata,
)
from workers.engine.pointwise import CPU_POINTWISE

# Head sizes the prefill kernel is compiled for, and the most query heads per KV head its
# tiles hold (kernels/cpu_paged_attention.cpp lists the same sizes); other models run
# their chunks through torch SDPA.
PREFILL_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
PREFILL_MAX_GROUP = 48


@dataclass(slots=True)
class PagedRows:
    """Rows that read the pool through block tables, as the kernels take them."""

    block_tables: torch.Tensor  # (rows, W) int32, padded with entries never read
    seq_lens: torch.Tensor  # (rows,) int32: keys after this step
    query_starts: torch.Tensor | None = None  # (rows + 1,) int32, chunks only


@dataclass(slots=True)
class CpuAttentionMetadata(StepMetadata):
    num_decodes: int
    decodes: PagedRows
    # Rows after the decodes: the prefill kernel's, or torch's for other head sizes.
    chunks: PagedRows | TorchAttentionMetadata | None


class CpuAttentionBackend(AttentionBackend):
    """Paged attention on the CPU: C++ kernels read the pool in place for decodes and for
    prefill chunks (the head sizes in PREFILL_HEAD_DIMS; torch SDPA over gathered blocks
    otherwise)."""

    name = "cpu"
    default_block_size = 16
    pointwise = CPU_POINTWISE  # the same kernel library: SwiGLU, rotary, add + RMSNorm

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self._torch = TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
        self._prefill_kernel = (
            head_dim in PREFILL_HEAD_DIMS and num_heads // num_kv_heads <= PREFILL_MAX_GROUP
        )

    def pool_workspace_ratio(self, num_layers: int) -> float:
        """Nothing is gathered where both kernels run; else chunks gather as torch's do."""
        return 0.0 if self._prefill_kernel else self._torch.pool_workspace_ratio(num_layers)

    def mask_bytes(self, max_num_batched_tokens: int, max_model_len: int, itemsize: int) -> int:
        """The kernels mask as they go; torch's chunks build masks."""
        if self._prefill_kernel:
            return 0
        return self._torch.mask_bytes(max_num_batched_tokens, max_model_len, itemsize)

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> CpuAttentionMetadata:
        """The shared paged metadata, split into decode rows and chunk rows (with query
        offsets from 0); for the torch path, the parent's metadata for the chunks."""
        nd = layout.num_decodes
        paged = paged_metadata(layout, device)
        chunks: PagedRows | TorchAttentionMetadata | None = None
        if nd < len(layout.query_lens):
            if self._prefill_kernel:
                chunks = PagedRows(paged.block_tables[nd:], paged.seq_lens[nd:],
                                   paged.cu_seqlens_q[nd:] - nd)
            else:
                rest = BatchLayout(
                    query_lens=layout.query_lens[nd:],
                    seq_lens=layout.seq_lens[nd:],
                    block_tables=layout.block_tables[nd:],
                    slot_mapping=layout.slot_mapping,  # unused: forward writes every row
                    num_decodes=0,
                    block_size=layout.block_size,
                    dtype=layout.dtype,
                )
                chunks = self._torch.build_metadata(rest, device)
        return CpuAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            num_decodes=nd,
            decodes=PagedRows(paged.block_tables[:nd], paged.seq_lens[:nd]),
            chunks=chunks,
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, metadata: StepMetadata,
               params: AttentionParams = FULL_ATTENTION) -> torch.Tensor:
        """Attend the decode rows in one kernel call, then the chunks in one."""
        meta = metadata
        assert isinstance(meta, CpuAttentionMetadata)
        nd = meta.num_decodes
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        ops = torch.ops.batchinfer_cpu
        # The kernels take 0 for "no window" and "no soft-capping".
        scale = self.scale_of(params)
        window, cap = params.sliding_window or 0, params.softcap or 0.0
        if nd:
            ops.paged_decode_attention(out[:nd], q[:nd], k_cache, v_cache,
                                       meta.decodes.block_tables, meta.decodes.seq_lens,
                                       scale, window, cap)
        if isinstance(meta.chunks, PagedRows):
            ops.paged_prefill_attention(out[nd:], q[nd:], k_cache, v_cache,
                                        meta.chunks.block_tables, meta.chunks.query_starts,
                                        meta.chunks.seq_lens, scale, window, cap)
        elif meta.chunks is not None:
            out[nd:] = self._torch.attend(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta.chunks,
                                          params)
        return out
