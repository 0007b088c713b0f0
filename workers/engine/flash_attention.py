"""flash-attn backend: paged attention on CUDA through `block_table`.

Mixed steps (prefill chunks with or without decodes) go through one
`flash_attn_varlen_func` call that reads K/V straight from the pool via the block table;
decode-only steps use `flash_attn_with_kvcache`, whose inputs are fixed-shape tensors and
so can be captured in a CUDA graph. A step of prefills with nothing cached attends the
chunks' own k/v without a block table: flash-attn's paged (split-KV) kernel is slower
there (its 64x256 tiles, about 27% at 2k tokens). flash-attn's paged KV needs blocks of a
multiple of 256 tokens, and the package needs an sm80+ GPU; it is optional and built
from source (see the README), the Triton backend covers CUDA without it.
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
    write_kv,
)

logger = logging.getLogger(__name__)

try:  # optional: CUDA sm80+ only, built from source with --no-build-isolation
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    HAS_FLASH_ATTN = True
except ImportError:
    HAS_FLASH_ATTN = False

FLASH_BLOCK_MULTIPLE = 256
MIN_FLASH_CAPABILITY = (8, 0)  # flash-attn 2 runs on Ampere and newer


@dataclass(slots=True)
class FlashAttentionMetadata:
    """Tensors flash-attn reads for one step, shared by every layer."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64
    seq_lens: torch.Tensor  # (num_seqs,) int32: cached + new tokens
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32
    is_decode_only: bool
    has_cached_context: bool = True  # False: every sequence is a fresh prefill chunk
    cu_seqlens_q: torch.Tensor | None = None  # (num_seqs + 1,) int32
    cu_seqlens_k: torch.Tensor | None = None  # (num_seqs + 1,) int32
    max_seqlen_q: int = 1
    max_seqlen_k: int = 0


class FlashAttentionBackend(AttentionBackend):
    """Paged attention with flash-attn kernels (CUDA, fp16/bf16)."""

    name = "flash"
    default_block_size = FLASH_BLOCK_MULTIPLE
    supports_cuda_graphs = True

    def check_block_size(self, block_size: int) -> None:
        """flash-attn pages only in multiples of 256 tokens."""
        if block_size < 1 or block_size % FLASH_BLOCK_MULTIPLE:
            raise ValueError(
                f"block_size must be a multiple of {FLASH_BLOCK_MULTIPLE} with the flash "
                f"attention backend, got {block_size}"
            )

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> FlashAttentionMetadata:
        """Cumulative lengths and a padded block table, copied to the device without a sync."""
        max_blocks = max(len(t) for t in layout.block_tables)
        # Unused table entries are never read (flash stops at seq_len); 0 keeps them valid.
        tables = [t + [0] * (max_blocks - len(t)) for t in layout.block_tables]
        block_tables = to_device(torch.tensor(tables, dtype=torch.int32), device)
        seq_lens = to_device(torch.tensor(layout.seq_lens, dtype=torch.int32), device)
        is_decode_only = layout.num_decodes == len(layout.query_lens)
        meta = FlashAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            seq_lens=seq_lens,
            block_tables=block_tables,
            is_decode_only=is_decode_only,
            max_seqlen_q=max(layout.query_lens),
            max_seqlen_k=max(layout.seq_lens),
        )
        if not is_decode_only:
            meta.has_cached_context = any(
                s > n for n, s in zip(layout.query_lens, layout.seq_lens, strict=True)
            )
            cu_q = [0]
            cu_k = [0]
            for n, s in zip(layout.query_lens, layout.seq_lens, strict=True):
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + s)
            meta.cu_seqlens_q = to_device(torch.tensor(cu_q, dtype=torch.int32), device)
            meta.cu_seqlens_k = to_device(torch.tensor(cu_k, dtype=torch.int32), device)
        return meta

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
    ) -> FlashAttentionMetadata:
        """Metadata over fixed buffers, for capturing and replaying decode CUDA graphs."""
        return FlashAttentionMetadata(
            slot_mapping=slot_mapping,
            seq_lens=seq_lens,
            block_tables=block_tables,
            is_decode_only=True,
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
        """Store k/v into the pool, then attend through the block table."""
        assert isinstance(metadata, FlashAttentionMetadata)
        meta = metadata
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_tokens = q.shape[0]
        # flash-attn's window counts keys left of the query: ours counts the query too.
        extra = {
            "softmax_scale": self.scale_of(params),
            "window_size": (-1, -1) if params.sliding_window is None
            else (params.sliding_window - 1, 0),
            "softcap": params.softcap or 0.0,
        }
        if meta.is_decode_only:
            # q (B, 1, H, D); cache_seqlens already counts the token written above.
            o = flash_attn_with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                causal=True,
                **extra,
            )
        elif not meta.has_cached_context:
            # Fresh prompts only: keys are the chunks themselves, no pool reads.
            o = flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q=meta.cu_seqlens_q,
                cu_seqlens_k=meta.cu_seqlens_q,
                max_seqlen_q=meta.max_seqlen_q,
                max_seqlen_k=meta.max_seqlen_q,
                causal=True,
                **extra,
            )
        else:
            # Causal masks align bottom-right, so a chunk of n queries over seq_len keys sees
            # exactly the cached prefix plus itself.
            o = flash_attn_varlen_func(
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=meta.cu_seqlens_q,
                cu_seqlens_k=meta.cu_seqlens_k,
                max_seqlen_q=meta.max_seqlen_q,
                max_seqlen_k=meta.max_seqlen_k,
                causal=True,
                **extra,
                block_table=meta.block_tables,
            )
        return o.reshape(num_tokens, self.num_heads * self.head_dim)
