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

import itertools
from dataclasses import dataclass

import torch

from workers.engine.attention import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionParams,
    BatchLayout,
    TorchAttentionBackend,
    TorchAttentionMetadata,
    to_device,
    write_kv,
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

    block_tables: torch.Tensor  # (rows, W) int32, padded with block 0 (never read)
    seq_lens: torch.Tensor  # (rows,) int32: keys after this step
    query_starts: torch.Tensor | None = None  # (rows + 1,) int32, chunks only


@dataclass(slots=True)
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # (N,) every row's pool slot
    num_decodes: int
    decodes: PagedRows
    # Rows after the decodes: the prefill kernel's, or torch's for other head sizes.
    chunks: PagedRows | TorchAttentionMetadata | None


def paged_rows(
    tables: list[list[int]], seq_lens: list[int], device: torch.device,
    query_lens: list[int] | None = None,
) -> PagedRows:
    """Block tables padded to one width, lengths (and query offsets) as int32 tensors."""
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    starts = None
    if query_lens is not None:
        offsets = list(itertools.accumulate(query_lens, initial=0))
        starts = to_device(torch.tensor(offsets, dtype=torch.int32), device)
    return PagedRows(
        to_device(torch.tensor(padded, dtype=torch.int32).view(len(tables), width), device),
        to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
        starts,
    )


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
        """Decode tables and lengths as int32 tensors; the chunks' the same way (with their
        query offsets) or, for the torch path, the parent's metadata."""
        nd = layout.num_decodes
        chunks: PagedRows | TorchAttentionMetadata | None = None
        if nd < len(layout.query_lens):
            if self._prefill_kernel:
                chunks = paged_rows(layout.block_tables[nd:], layout.seq_lens[nd:], device,
                                    layout.query_lens[nd:])
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
            decodes=paged_rows(layout.block_tables[:nd], layout.seq_lens[:nd], device),
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
        params: AttentionParams = FULL_ATTENTION,
    ) -> torch.Tensor:
        """Store k/v, attend the decode rows in one kernel call, then the chunks in one."""
        assert isinstance(metadata, CpuAttentionMetadata)
        meta = metadata
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
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
