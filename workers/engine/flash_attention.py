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

import itertools
import logging
from dataclasses import dataclass

import torch

from workers.engine.attention import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionParams,
    BatchLayout,
    PagedMetadata,
    StepMetadata,
    paged_metadata,
    to_device,
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
class FlashAttentionMetadata(PagedMetadata):
    """The shared paged metadata, plus what flash-attn's varlen call reads of mixed steps."""

    has_cached_context: bool = True  # False: every sequence is a fresh prefill chunk
    cu_seqlens_k: torch.Tensor | None = None  # (num_seqs + 1,) int32


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
        """The shared paged metadata; for mixed steps also cumulative key lengths."""
        paged = paged_metadata(layout, device)
        meta = FlashAttentionMetadata(
            paged.slot_mapping, paged.block_tables, paged.seq_lens, paged.cu_seqlens_q,
            paged.max_query_len, paged.max_seq_len,
        )
        if meta.max_query_len > 1:
            meta.has_cached_context = any(
                s > n for n, s in zip(layout.query_lens, layout.seq_lens, strict=True)
            )
            cu_k = list(itertools.accumulate(layout.seq_lens, initial=0))
            meta.cu_seqlens_k = to_device(torch.tensor(cu_k, dtype=torch.int32), device)
        return meta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, metadata: StepMetadata,
               params: AttentionParams = FULL_ATTENTION) -> torch.Tensor:
        """Attend through the block table (decode-only steps: the graph-capturable call)."""
        meta = metadata
        assert isinstance(meta, PagedMetadata)
        # Mixed steps come from build_metadata; decode-only ones may come from graph buffers.
        mixed = meta if isinstance(meta, FlashAttentionMetadata) else None
        num_tokens = q.shape[0]
        # flash-attn's window counts keys left of the query: ours counts the query too.
        extra = {
            "softmax_scale": self.scale_of(params),
            "window_size": (-1, -1) if params.sliding_window is None
            else (params.sliding_window - 1, 0),
            "softcap": params.softcap or 0.0,
        }
        if meta.max_query_len == 1:
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
        elif mixed is None:
            raise ValueError("a mixed step needs build_metadata's flash-attn metadata")
        elif not mixed.has_cached_context:
            # Fresh prompts only: keys are the chunks themselves, no pool reads.
            o = flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q=meta.cu_seqlens_q,
                cu_seqlens_k=meta.cu_seqlens_q,
                max_seqlen_q=meta.max_query_len,
                max_seqlen_k=meta.max_query_len,
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
                cu_seqlens_k=mixed.cu_seqlens_k,
                max_seqlen_q=meta.max_query_len,
                max_seqlen_k=meta.max_seq_len,
                causal=True,
                **extra,
                block_table=meta.block_tables,
            )
        return o.reshape(num_tokens, self.num_heads * self.head_dim)
