"""CPU backend: decodes read the paged pool in place through the C++ kernel.

The torch backend gathers each decode group's blocks into a workspace and runs one SDPA
call per group and layer (about 20 groups at batch 64); on a SmolLM2-135M decode step that
was a third of the step. Here all decode rows of a layer are one call of
`torch.ops.batchinfer_cpu.paged_decode_attention` (kernels/cpu_paged_attention.cpp), which
walks each sequence's block table and never copies K/V. Longer chunks (prefill with cached
context) are the torch backend's, unchanged: they are few and compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.attention import (
    AttentionBackend,
    BatchLayout,
    TorchAttentionBackend,
    TorchAttentionMetadata,
    to_device,
    write_kv,
)
from workers.engine.pointwise import CPU_POINTWISE


@dataclass(slots=True)
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # (N,) every row's pool slot
    num_decodes: int
    block_tables: torch.Tensor  # (num_decodes, W) int32, padded with block 0 (never read)
    seq_lens: torch.Tensor  # (num_decodes,) int32
    chunks: TorchAttentionMetadata | None  # rows after the decodes, numbered from 0


class CpuAttentionBackend(AttentionBackend):
    """Paged attention on the CPU: C++ kernel for decodes, torch SDPA for longer chunks."""

    name = "cpu"
    default_block_size = 16
    pointwise = CPU_POINTWISE  # the same kernel library: SwiGLU, rotary, add + RMSNorm

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self._torch = TorchAttentionBackend(num_heads, num_kv_heads, head_dim)

    def pool_workspace_ratio(self, num_layers: int) -> float:
        """Chunks gather as the torch path does (decodes read in place)."""
        return self._torch.pool_workspace_ratio(num_layers)

    def mask_bytes(self, max_num_batched_tokens: int, max_model_len: int, itemsize: int) -> int:
        """Chunks' masks, as the torch path builds them."""
        return self._torch.mask_bytes(max_num_batched_tokens, max_model_len, itemsize)

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> CpuAttentionMetadata:
        """Decode tables and lengths as int32 tensors; the chunks' metadata from the parent."""
        nd = layout.num_decodes
        tables = layout.block_tables[:nd]
        width = max((len(t) for t in tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in tables]
        chunks = None
        if nd < len(layout.query_lens):
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
            block_tables=to_device(torch.tensor(padded, dtype=torch.int32).view(nd, width), device),
            seq_lens=to_device(torch.tensor(layout.seq_lens[:nd], dtype=torch.int32), device),
            chunks=chunks,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """Store k/v, attend the decode rows in one kernel call, then the chunks."""
        assert isinstance(metadata, CpuAttentionMetadata)
        meta = metadata
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes
        parts = []
        if nd:
            out = q.new_empty(nd, self.num_heads * self.head_dim)
            torch.ops.batchinfer_cpu.paged_decode_attention(
                out, q[:nd], k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale
            )
            parts.append(out)
        if meta.chunks is not None:
            parts.append(self._torch.attend(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta.chunks))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
