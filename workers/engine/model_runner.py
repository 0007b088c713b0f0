"""Runs the model for the scheduler: one forward pass per step over a mixed batch.

Responsible for resolving and loading the model, choosing the attention backend and block
size, sizing and owning the KV pool, packing (sequences, scheduled token counts) into flat
tensors with their pool slots, running the forward (eagerly, or from a captured decode CUDA
graph), computing logits only for the sequences that sample this step, and sampling.
It reads sequences and never changes them.
"""

from __future__ import annotations

import logging
from array import array
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PretrainedConfig

from workers.engine.attention import BatchLayout, to_device
from workers.engine.block_tables import BlockTableRows
from workers.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from workers.engine.cpu_threads import CpuThreadGovernor
from workers.engine.cuda_graphs import DecodeGraphs
from workers.engine.grammar import StepMasks
from workers.engine.loader import load_hf_config, load_model, read_eos_token_ids
from workers.engine.models import check_supported, head_dim_of
from workers.engine.placement import (
    packing_dtype,
    pick_backend,
    pick_device,
    pick_dtype,
    pick_kv_dtype,
)
from workers.engine.registry import resolve_model
from workers.engine.sampler import SampledToken, Sampler
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

logger = logging.getLogger(__name__)

_CPU_KV_BYTES = 1 << 30
# Prompt positions whose logprobs go through the vocabulary projection at once: a
# 2,048-token chunk at a 49,152-token vocabulary would be 400 MB of fp32 logits.
PROMPT_LOGPROB_ROWS = 256


@dataclass(slots=True)
class _Step:
    """Host-side packing of one step; rows ordered decodes first (see attention.py)."""

    order: list[int] = field(default_factory=list)  # batch row -> index into seqs
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    num_decodes: int = 0
    sample_token_rows: list[int] = field(default_factory=list)  # last token of sampling seqs
    sample_seq_indices: list[int] = field(default_factory=list)
    # Decode rows that are one-token chunks short of a prompt's end (not sampling).
    mid_prompt: list[int] = field(default_factory=list)


@dataclass(slots=True)
class PendingTokens:
    """The sampled tokens of a step that may still be running on the GPU."""

    num_seqs: int
    indices: list[int]  # sequences that sample this step, ascending
    params: list[SamplingParams]
    token_ids: torch.Tensor | None  # (len(indices),) int64, on the host once `event` is done
    logprobs: torch.Tensor | None
    event: torch.cuda.Event | None  # None: already complete (CPU)

    def result(self) -> list[SampledToken | None]:
        """Wait for the step; a token per sequence that sampled, None for the others."""
        results: list[SampledToken | None] = [None] * self.num_seqs
        if self.token_ids is None:
            return results
        if self.event is not None:
            self.event.synchronize()
        tokens = Sampler.to_host(self.token_ids, self.logprobs, self.params)
        for i, token in zip(self.indices, tokens, strict=True):
            results[i] = token
        return results


class ModelRunner:
    """Owns the model, the KV pool and the sampler; executes scheduled batches."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir: Path = resolve_model(config.model, config.models_dir)
        self.hf_config: PretrainedConfig = load_hf_config(self.model_dir)
        check_supported(self.hf_config)
        self.device = pick_device(config.device)
        if self.device.type == "cuda":
            # cuda:N must be the current device: graphs capture on the current device's
            # stream, and Triton launches on it.
            torch.cuda.set_device(self.device)
        self.dtype = pick_dtype(config.dtype, self.hf_config, self.device,
                                quantized_weights=config.quantized_weights)
        self.kv_dtype = pick_kv_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.backend = pick_backend(
            config.attention_backend, self.device, self.dtype, self.hf_config, self.kv_dtype
        )
        self.block_size = config.block_size or self.backend.default_block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens or (
            DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda" if self.device.type == "cuda" else "cpu"])
        self.backend.check_block_size(self.block_size)
        self.max_model_len = min(
            config.max_model_len or self.hf_config.max_position_embeddings,
            self.hf_config.max_position_embeddings,
        )
        self.eos_token_ids = read_eos_token_ids(self.model_dir, self.hf_config)
        self.model = load_model(
            self.model_dir, self.hf_config, self.backend, self.dtype, self.device,
            quantized_weights=config.quantized_weights,
        )
        longrope = self.model.longrope
        # A sequence in longrope's long mode reads the table's long rows (see rotary.py).
        self.longrope_switch: int | None = None if longrope is None else longrope[0]
        self._long_rope_offset = 0 if longrope is None else longrope[1]
        packed_dtype = packing_dtype(self.device, self.dtype)
        if packed_dtype is not None:
            self.model.pack_weights(packed_dtype)
        self.sampler = Sampler(config.seed, self.device)
        # On the CPU, ops use as many threads as other processes leave cores free.
        self.threads = CpuThreadGovernor() if self.device.type == "cpu" else None
        self.graphs: DecodeGraphs | None = None  # captured once the pool exists
        # Twice the running cap: rows of sequences that left are reclaimed only in bulk.
        self.block_tables = BlockTableRows(
            2 * config.max_num_seqs + 8, -(-self.max_model_len // self.block_size)
        )
        self.num_kv_blocks = self._count_kv_blocks()
        # One extra block at the end: scratch space for padded CUDA-graph rows; the block
        # manager only ever sees ids 0..num_kv_blocks-1. Zeroed so masked reads stay finite.
        self.kv_cache = self._new_pool(self.num_kv_blocks + 1)
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_graphs()
        logger.info(
            "model runner ready: %s, %s on %s, %s attention, %d KV blocks of %d tokens in %s",
            self.model_dir.name, self.dtype, self.device, self.backend.name,
            self.num_kv_blocks, self.block_size, str(self.kv_dtype).removeprefix("torch."),
        )  # fmt: skip

    def execute(
        self, seqs: list[Sequence], num_scheduled_tokens: list[int]
    ) -> list[SampledToken | None]:
        """One forward pass over a mixed batch (prefill chunks and decodes together).

        Computes positions c..c+n-1 of each sequence (c = num_computed_tokens,
        n = num_scheduled_tokens[i]), writes their K/V into the pool, and returns a sampled
        token for every sequence that reaches its last token (c + n == num_tokens), else None.
        """
        return self.execute_async(seqs, num_scheduled_tokens).result()

    @torch.inference_mode()
    def execute_async(
        self,
        seqs: list[Sequence],
        num_scheduled_tokens: list[int],
        masks: Future[StepMasks] | None = None,
    ) -> PendingTokens:
        """execute() without waiting: on CUDA the step is queued on the GPU and its tokens
        start copying to pinned host memory; the host is free until result().

        `masks` (rows: the sequences that sample this step, in ascending order) are being
        filled on another thread while the forward runs; they are awaited only before
        sampling.
        """
        indices, logits = self.compute_logits(seqs, num_scheduled_tokens)
        step_masks = masks.result() if masks is not None else None
        if not indices:
            return PendingTokens(len(seqs), [], [], None, None, None)
        # One pass over the sampling sequences (this runs for every row of every step).
        params: list[SamplingParams] = []
        steps: list[int] = []
        penalized = False
        for i in indices:
            seq = seqs[i]
            p = seq.params
            params.append(p)
            steps.append(len(seq.token_ids) - seq.num_prompt_tokens)
            penalized = penalized or p.has_penalties
        output_ids = [seqs[i].output_token_ids for i in indices] if penalized else None
        token_ids, logprobs = self.sampler.sample_on_device(
            logits, params, steps, output_token_ids=output_ids, masks=step_masks
        )
        event = None
        if self.device.type == "cuda":
            # Pinned destinations make both copies asynchronous; the event marks their end.
            token_ids = token_ids.to("cpu", non_blocking=True)
            logprobs = None if logprobs is None else logprobs.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return PendingTokens(len(seqs), indices, params, token_ids, logprobs, event)

    @torch.inference_mode()
    def compute_logits(
        self, seqs: list[Sequence], num_scheduled_tokens: list[int]
    ) -> tuple[list[int], torch.Tensor]:
        """The forward pass of execute(), without sampling.

        Returns the ascending indices (into seqs) of the sequences that reach their last
        token, and float32 logits (len(indices), vocab) of that token, one row per index.
        """
        if len(seqs) != len(num_scheduled_tokens):
            raise ValueError("num_scheduled_tokens must have one entry per sequence")
        if not seqs:
            return [], torch.empty(0, self.hf_config.vocab_size, device=self.device)
        if self.threads is not None:
            self.threads.adjust()
        step = self._pack(seqs, num_scheduled_tokens)
        graphs = self.graphs
        max_blocks = max(len(t) for t in step.block_tables)
        if (
            graphs is not None
            and step.num_decodes == len(seqs)
            and graphs.can_run(len(seqs), max_blocks)
        ):
            hidden = graphs.run(
                step.input_ids, step.positions, step.slot_mapping, step.seq_lens, step.block_tables
            )
        else:
            hidden = self._forward_eager(step, seqs)
        # Only rows of prompt chunks can carry prompt positions: the prefill rows, and the
        # rare one-token chunk in the middle of a prompt among the decodes.
        if any(seqs[i].params.prompt_logprobs is not None
               for i in (*step.order[step.num_decodes:], *step.mid_prompt)):
            self._record_prompt_logprobs(step, seqs, hidden)
        if not step.sample_seq_indices:
            return [], hidden.new_empty(0, self.hf_config.vocab_size, dtype=torch.float32)
        rows = to_device(torch.frombuffer(array("q", step.sample_token_rows), dtype=torch.int64),
                         self.device)
        # Only the last token of each sampling sequence reaches the vocab projection.
        return step.sample_seq_indices, self.model.compute_logits(hidden.index_select(0, rows))

    def _record_prompt_logprobs(self, step: _Step, seqs: list[Sequence],
                                hidden: torch.Tensor) -> None:
        """For the sequences that ask for them, each computed prompt position's logprob of
        the next prompt token (and the alternatives), appended to the sequence: position p
        of a chunk is row `row + p - start`, and predicts token p + 1."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[Sequence] = []
        row = 0
        for i, n in zip(step.order, step.query_lens, strict=True):
            seq = seqs[i]
            if seq.params.prompt_logprobs is not None:
                start = seq.num_computed_tokens
                # Positions already recorded (a recompute after preemption) are skipped.
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(start + n, seq.num_prompt_tokens - 1)
                for p in range(first, last):
                    rows.append(row + p - start)
                    targets.append(seq.token_ids[p + 1])
                    owners.append(seq)
            row += n
        for lo in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            part = slice(lo, lo + PROMPT_LOGPROB_ROWS)
            index = torch.tensor(rows[part], dtype=torch.int64, device=hidden.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden.index_select(0, index))
                                         .float(), dim=-1)
            wanted = torch.tensor(targets[part], dtype=torch.int64, device=hidden.device)
            chosen = logprobs.gather(1, wanted[:, None])[:, 0].tolist()
            k = max(seq.params.prompt_logprobs or 0 for seq in owners[part])
            tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
            if k:
                top = logprobs.topk(k, dim=-1)
                tops = [list(zip(ids, values, strict=True)) for ids, values
                        in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
            for seq, logprob, alternatives in zip(owners[part], chosen, tops, strict=True):
                seq.prompt_logprobs.append(logprob)
                seq.prompt_top_logprobs.append(alternatives[:seq.params.prompt_logprobs or 0])

    def _forward_eager(self, step: _Step, seqs: list[Sequence]) -> torch.Tensor:
        """Run the model without graphs; hidden states (N, hidden) in batch-row order."""
        # Token ids, positions and slots: one host tensor, one copy.
        n = len(step.input_ids)
        # array() converts a list of ints several times faster than torch.tensor().
        values = array("q", step.input_ids + step.positions + step.slot_mapping)
        packed = to_device(torch.frombuffer(values, dtype=torch.int64), self.device)
        layout = BatchLayout(
            query_lens=step.query_lens,
            seq_lens=step.seq_lens,
            block_tables=step.block_tables,
            slot_mapping=packed[2 * n :],
            num_decodes=step.num_decodes,
            block_size=self.block_size,
            dtype=self.dtype,
        )
        if self.backend.reads_block_table_tensor:
            layout.block_table_tensor = self.block_tables.gather([seqs[i] for i in step.order])
        metadata = self.backend.build_metadata(layout, self.device)
        return self.model(packed[:n], packed[n : 2 * n], self.kv_cache, metadata)

    def _pack(self, seqs: list[Sequence], num_scheduled_tokens: list[int]) -> _Step:
        """Order rows (decodes first, shortest first) and list tokens, positions and slots."""
        bs = self.block_size
        decodes = [i for i, n in enumerate(num_scheduled_tokens) if n == 1]
        computed = [seq.num_computed_tokens for seq in seqs]
        decodes.sort(key=computed.__getitem__)  # a C-level key: no Python call per row
        others = [i for i, n in enumerate(num_scheduled_tokens) if n != 1]
        step = _Step(order=decodes + others, num_decodes=len(decodes))
        # Decodes, the bulk of a large batch: one token at position c = num_computed_tokens.
        max_len = self.max_model_len
        input_ids, positions, slots = step.input_ids, step.positions, step.slot_mapping
        for i in decodes:
            seq = seqs[i]
            c, table, token_ids = seq.num_computed_tokens, seq.block_table, seq.token_ids
            if c >= len(token_ids) or c >= max_len or len(table) * bs <= c:
                self._check_scheduled(seq, 1, c + 1)  # raises: the scheduler broke the contract
            input_ids.append(token_ids[c])
            positions.append(c)
            slots.append(table[c // bs] * bs + c % bs)
            step.seq_lens.append(c + 1)
            step.block_tables.append(table)
            if c + 1 == len(token_ids):
                step.sample_token_rows.append(len(input_ids) - 1)
                step.sample_seq_indices.append(i)
            else:
                step.mid_prompt.append(i)
        step.query_lens += [1] * len(decodes)
        for i in others:
            seq, n = seqs[i], num_scheduled_tokens[i]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            self._check_scheduled(seq, n, end)
            step.input_ids += seq.token_ids[start:end]
            step.positions += range(start, end)
            # Slots block by block: e.g. block_size 16, positions 14..17 of table [7, 2] ->
            # 7*16+14, 7*16+15 from block 7, then 2*16+0, 2*16+1 from block 2.
            pos = start
            while pos < end:
                block_end = min(end, (pos // bs + 1) * bs)
                base = seq.block_table[pos // bs] * bs - (pos // bs) * bs
                step.slot_mapping += range(base + pos, base + block_end)
                pos = block_end
            step.query_lens.append(n)
            step.seq_lens.append(end)
            step.block_tables.append(seq.block_table)
            if end == seq.num_tokens:
                step.sample_token_rows.append(len(step.input_ids) - 1)
                step.sample_seq_indices.append(i)
        # Logits rows follow the caller's sequence order, not the internal row order: a
        # scatter by sequence index, cheaper than sorting (index, row) pairs.
        row_of: list[int] = [-1] * len(seqs)
        for i, row in zip(step.sample_seq_indices, step.sample_token_rows, strict=True):
            row_of[i] = row
        step.sample_seq_indices = [i for i, row in enumerate(row_of) if row >= 0]
        step.sample_token_rows = [row for row in row_of if row >= 0]
        if self._long_rope_offset:
            self._offset_long_rope(step, seqs)
        return step

    def _offset_long_rope(self, step: _Step, seqs: list[Sequence]) -> None:
        """Positions of sequences in longrope's long mode moved to the table's long rows."""
        offset, positions, row = self._long_rope_offset, step.positions, 0
        for i, n in zip(step.order, step.query_lens, strict=True):
            if seqs[i].rope_long:
                positions[row:row + n] = [p + offset for p in positions[row:row + n]]
            row += n

    def _check_scheduled(self, seq: Sequence, n: int, end: int) -> None:
        """Scheduler/runner contract checks, cheap enough to run on every step."""
        if n < 1 or end > seq.num_tokens:
            raise ValueError(
                f"num_scheduled_tokens {n} for {seq.request_id} must be in "
                f"[1, {seq.num_tokens - seq.num_computed_tokens}]"
            )
        if end > self.max_model_len:
            raise ValueError(
                f"{seq.request_id} reaches {end} tokens > max_model_len {self.max_model_len}"
            )
        if len(seq.block_table) * self.block_size < end:
            raise ValueError(f"block_table of {seq.request_id} does not cover position {end - 1}")

    def _count_kv_blocks(self) -> int:
        """Blocks from num_kv_blocks, a byte budget, free CUDA memory, or up to 1 GiB on CPU."""
        config = self.config
        if config.num_kv_blocks is not None:
            if config.num_kv_blocks < 1:
                raise ValueError(f"num_kv_blocks must be >= 1, got {config.num_kv_blocks}")
            return config.num_kv_blocks
        if config.kv_cache_memory_bytes is not None:
            budget = config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            # The CPU default is capped at what max_num_seqs full-length sequences can
            # hold: a tiny model would otherwise zero (and keep resident) a whole GiB.
            blocks_per_seq = -(-self.max_model_len // self.block_size)
            needed = self.config.max_num_seqs * blocks_per_seq * self._block_bytes()
            budget = min(_CPU_KV_BYTES, needed)
        num_blocks = budget // self._block_bytes()
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes ({budget} available) holds no {self._block_bytes()}-byte "
                f"block; raise it or gpu_memory_utilization"
            )
        return int(num_blocks)

    def _block_bytes(self) -> int:
        layers = self.hf_config.num_hidden_layers
        kv_heads = getattr(self.hf_config, "num_key_value_heads", None) or (
            self.hf_config.num_attention_heads
        )
        itemsize = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * layers * self.block_size * kv_heads * head_dim_of(self.hf_config) * itemsize

    def _new_pool(self, num_blocks: int) -> torch.Tensor:
        """(2, layers, num_blocks, block_size, Hkv, D): K and V of every layer in one tensor."""
        kv_heads = getattr(self.hf_config, "num_key_value_heads", None) or (
            self.hf_config.num_attention_heads
        )
        shape = (
            2, self.hf_config.num_hidden_layers, num_blocks, self.block_size,
            kv_heads, head_dim_of(self.hf_config),
        )  # fmt: skip
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _cuda_kv_budget(self) -> int:
        """gpu_memory_utilization of free memory, less every workspace a step can need.

        Measured: the largest prefill step's activations and attention metadata, and the
        sampler's temporaries for a full batch with top-k, top-p and logprobs. Computed
        (the profile step has nothing cached): the torch backend's masks over cached
        context, and its gather workspace, which grows with the pool itself.
        """
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_step()
        self._profile_sampler()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        masks = self.backend.mask_bytes(
            self.max_num_batched_tokens, self.max_model_len, itemsize
        )
        budget = int(free * self.config.gpu_memory_utilization) - peak - masks
        ratio = self.backend.pool_workspace_ratio(self.hf_config.num_hidden_layers)
        return int(budget / (1 + ratio))

    def _profile_sampler(self) -> None:
        """Sample a full batch of vocab-wide rows with every option that allocates."""
        num_rows = self.config.max_num_seqs
        logits = torch.zeros(num_rows, self.hf_config.vocab_size, device=self.device)
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=True, seed=0)
        self.sampler.sample(logits, [params] * num_rows, [0] * num_rows)

    def _profile_step(self) -> None:
        """Run the largest prefill step once on a throwaway pool to measure activations."""
        num_tokens = min(self.max_num_batched_tokens, self.max_model_len * 64)
        lengths: list[int] = []
        while num_tokens > 0 and len(lengths) < self.config.max_num_seqs:
            lengths.append(min(num_tokens, self.max_model_len))
            num_tokens -= lengths[-1]
        blocks = [-(-n // self.block_size) for n in lengths]
        self.kv_cache = self._new_pool(sum(blocks) + 1)
        seqs: list[Sequence] = []
        first = 0
        for i, (n, nb) in enumerate(zip(lengths, blocks, strict=True)):
            seq = Sequence(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1, temperature=0))
            seq.block_table = list(range(first, first + nb))
            first += nb
            seqs.append(seq)
        self.execute(seqs, lengths)
        del self.kv_cache

    def _capture_graphs(self) -> None:
        if not self.backend.supports_cuda_graphs:
            logger.warning(
                "the %s attention backend cannot run in CUDA graphs; decode runs eagerly",
                self.backend.name,
            )
            return
        self.graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.kv_cache,
            max_batch_size=min(self.config.max_num_seqs, 512),
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            scratch_block=self.num_kv_blocks,
            block_size=self.block_size,
        )
        self.graphs.capture()
