"""Decode steps replayed from CUDA graphs, captured once per batch size at start-up.

Responsible for the fixed input/output buffers the graphs read and write, for capturing
one graph per batch size in `capture_sizes(max_batch_size)` (largest first, sharing one
memory pool), and for padding a decode batch up to the next captured size. Padded rows
write into and read from a scratch block the block manager never hands out, so they
cannot disturb real sequences. Nothing is captured again after start-up.

Any backend with `supports_cuda_graphs` (Triton, flash-attn) works: it builds its decode
metadata over the buffers here, whose addresses stay fixed while their contents change.
A captured forward must not sync with the host, read host memory or allocate outside the
graph's pool; tests check that with a capture emulator on the CPU.
"""

from __future__ import annotations

import bisect
import logging

import torch

from workers.engine.attention import AttentionBackend
from workers.engine.models import CausalLM

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch_size (always included)."""
    sizes = [s for s in [1, 2, 4, 8, *range(16, max_batch_size + 1, 16)] if s <= max_batch_size]
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


class DecodeGraphs:
    """Captured decode forwards for every batch size in capture_sizes(max_batch_size)."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
        *,
        max_batch_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        block_size: int,
    ) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name} attention backend cannot run in CUDA graphs")
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_batch_size)
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        device = kv_cache.device
        n = self.sizes[-1]
        embed = model.embed_tokens.weight  # the activations' dtype (the pool's may be fp8)
        hidden_size = embed.shape[1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        # One query per sequence: row i's queries are i..i+1, for every batch size.
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full(
            (n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device
        )
        self.hidden = torch.zeros(n, hidden_size, dtype=embed.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def can_run(self, batch_size: int, max_blocks: int) -> bool:
        """True when a captured graph fits this many sequences and block-table entries."""
        return batch_size <= self.sizes[-1] and max_blocks <= self.block_tables.shape[1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first so smaller ones reuse its memory."""
        pool = None
        for size in reversed(self.sizes):
            meta = self.backend.decode_metadata(
                self.slot_mapping[:size],
                self.seq_lens[:size],
                self.block_tables[:size],
                self.cu_seqlens_q[: size + 1],
            )
            args = (self.input_ids[:size], self.positions[:size], self.kv_cache, meta)
            self.hidden[:size] = self.model(*args)  # warm-up: lazy kernel initialisation
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:size] = self.model(*args)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """Replay the graph of the next size up; returns hidden states (B, hidden).

        The result is a view of a buffer the next replay overwrites.
        """
        batch = len(input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, batch)]
        pad = size - batch
        width = max(len(t) for t in block_tables)
        tables = [t + [self.scratch_block] * (width - len(t)) for t in block_tables]
        tables += [[self.scratch_block] * width] * pad
        # One host tensor per dtype, pinned on CUDA; the caching host allocator keeps each
        # alive until its asynchronous copy has finished, so none is overwritten in flight.
        rows = torch.tensor(
            [
                input_ids + [0] * pad,
                positions + [0] * pad,
                slot_mapping + [self.scratch_slot] * pad,
            ],
            dtype=torch.int64,
        )
        lens = torch.tensor(seq_lens + [1] * pad, dtype=torch.int32)
        table = torch.tensor(tables, dtype=torch.int32)
        is_cuda = self.input_ids.device.type == "cuda"
        if is_cuda:
            rows, lens, table = rows.pin_memory(), lens.pin_memory(), table.pin_memory()
        self.input_ids[:size].copy_(rows[0], non_blocking=is_cuda)
        self.positions[:size].copy_(rows[1], non_blocking=is_cuda)
        self.slot_mapping[:size].copy_(rows[2], non_blocking=is_cuda)
        self.seq_lens[:size].copy_(lens, non_blocking=is_cuda)
        self.block_tables[:size, :width].copy_(table, non_blocking=is_cuda)
        self.graphs[size].replay()
        return self.hidden[:batch]
