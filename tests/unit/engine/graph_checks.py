"""Decode CUDA graphs of a tiny random model, replayed through the capture emulator.

Shared by the flash-attn stand-in tests (main process) and the Triton tests (run under
Triton's interpreter): `DecodeCase` builds a model, a pool holding random cached K/V and
captured graphs; `decode_batch` draws a batch of decodes with scattered block tables.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig

from tests.unit.engine.checkpoints import TINY
from workers.engine.attention import AttentionBackend, BatchLayout
from workers.engine.cuda_graphs import DecodeGraphs
from workers.engine.models.llama import LlamaForCausalLM


@dataclass(slots=True)
class DecodeBatch:
    """Host lists of one decode step, as the model runner hands them to DecodeGraphs.run."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]


class DecodeCase:
    """A tiny Llama on `backend`, a pool of random cached K/V, graphs up to max_batch_size."""

    def __init__(
        self,
        backend_cls: type[AttentionBackend],
        dtype: torch.dtype,
        block_size: int,
        *,
        num_blocks: int = 40,
        max_blocks_per_seq: int = 4,
        max_batch_size: int = 8,
        device: torch.device | None = None,
    ) -> None:
        options: dict[str, Any] = {**TINY, "max_position_embeddings": 1024}
        config = LlamaConfig(**options)
        heads, kv_heads = options["num_attention_heads"], options["num_key_value_heads"]
        head_dim = options["hidden_size"] // heads
        self.backend = backend_cls(heads, kv_heads, head_dim)
        torch.manual_seed(0)
        device = device or torch.device("cpu")
        with torch.device(device):  # built in place: fake tensors cannot be moved later
            self.model = LlamaForCausalLM(config, self.backend).eval()
        if dtype != torch.float32:
            self.model = self.model.to(dtype)
        self.model.reset_buffers(device, dtype)
        for p in self.model.parameters():  # larger weights: differences show in the output
            p.data.normal_(0, 0.3)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = max_blocks_per_seq
        layers = options["num_hidden_layers"]
        shape = (2, layers, num_blocks + 1, block_size, kv_heads, head_dim)
        self.kv_cache = torch.randn(shape, device=device).to(dtype)
        self.kv_cache[:, :, num_blocks] = 0  # the scratch block, as the runner zeroes it
        self.graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.kv_cache,
            max_batch_size=max_batch_size,
            max_blocks_per_seq=max_blocks_per_seq,
            scratch_block=num_blocks,
            block_size=block_size,
        )

    def decode_batch(self, batch_size: int, max_width: int, seed: int) -> DecodeBatch:
        """batch_size decodes whose tables are 1..max_width blocks of distinct pool blocks."""
        rng = random.Random(seed)
        free = list(range(self.num_blocks))
        rng.shuffle(free)
        batch = DecodeBatch([], [], [], [], [])
        for i in range(batch_size):
            # The first row takes the full width so the batch's table width is max_width.
            width = max_width if i == 0 else rng.randint(1, max_width)
            table, free = free[:width], free[width:]
            seq_len = rng.randint((width - 1) * self.block_size + 1, width * self.block_size)
            pos = seq_len - 1
            batch.input_ids.append(rng.randrange(3, 256))
            batch.positions.append(pos)
            batch.slot_mapping.append(
                table[pos // self.block_size] * self.block_size + pos % self.block_size
            )
            batch.seq_lens.append(seq_len)
            batch.block_tables.append(table)
        return batch

    @torch.inference_mode()
    def eager_on_graph_buffers(self, batch_size: int) -> torch.Tensor:
        """The captured size's forward run eagerly over the graph's current input buffers."""
        g = self.graphs
        size = next(s for s in g.sizes if s >= batch_size)
        meta = self.backend.decode_metadata(
            g.slot_mapping[:size],
            g.seq_lens[:size],
            g.block_tables[:size],
            g.cu_seqlens_q[: size + 1],
        )
        return self.model(g.input_ids[:size], g.positions[:size], self.kv_cache, meta)[:batch_size]

    @torch.inference_mode()
    def eager_step(self, batch: DecodeBatch) -> torch.Tensor:
        """The unpadded eager path of the model runner (build_metadata) for the same batch."""
        layout = BatchLayout(
            query_lens=[1] * len(batch.input_ids),
            seq_lens=batch.seq_lens,
            block_tables=batch.block_tables,
            slot_mapping=torch.tensor(batch.slot_mapping, device=self.kv_cache.device),
            num_decodes=len(batch.input_ids),
            block_size=self.block_size,
            dtype=self.kv_cache.dtype,
        )
        meta = self.backend.build_metadata(layout, self.kv_cache.device)
        device = self.kv_cache.device
        ids = torch.tensor(batch.input_ids, device=device)
        positions = torch.tensor(batch.positions, device=device)
        return self.model(ids, positions, self.kv_cache, meta)

    @torch.inference_mode()
    def replay(self, batch: DecodeBatch) -> torch.Tensor:
        """DecodeGraphs.run for the batch; a copy, the buffer is reused by the next replay."""
        return self.graphs.run(
            batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens, batch.block_tables
        ).clone()
