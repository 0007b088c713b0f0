"""Drives a Scheduler without a model: synthetic tokens and a simulated KV pool.

The simulated pool records, for every slot, which token at which position was written
there. Each step checks what a real model runner relies on: every position a sequence
attends to holds that sequence's own token, the block table covers every position
written, and nothing writes into a block another sequence shares or the cache owns.
Sampled tokens are a pure function of (request, output index), so a run with preemptions
must produce exactly the tokens of a run without any.
"""

from __future__ import annotations

import hashlib
from typing import Any

from workers.engine.block_manager import BlockManager
from workers.engine.sampler import SampledToken
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerOutput, urgency
from workers.engine.sequence import Sequence
from workers.engine.step_cost import StepCostModel


def synthetic_token(seq: Sequence, vocab_size: int = 1000) -> int:
    """The token a deterministic 'model' samples next for this sequence."""
    key = f"{seq.request_id}:{seq.num_output_tokens}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") % vocab_size


EOS = 2


class SchedulerDriver:
    """Runs schedule → simulated execute → postprocess, checking invariants every step."""

    def __init__(self, scheduler: Scheduler, vocab_size: int = 1000) -> None:
        self.scheduler = scheduler
        self.bm: BlockManager = scheduler.block_manager
        self.vocab_size = vocab_size
        # slot -> (token id, position) last written there
        self.pool: dict[int, tuple[int, int]] = {}
        self.outputs: list[SchedulerOutput] = []

    def slot(self, seq: Sequence, pos: int) -> int:
        """Flat KV slot of one position of a sequence."""
        bs = self.bm.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def step(self) -> tuple[SchedulerOutput, list[Sequence]]:
        """One engine step with synthetic tokens; asserts the invariants."""
        out = self.scheduler.schedule()
        self.check(out)
        sampled: list[SampledToken | None] = []
        for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
            c = seq.num_computed_tokens
            for pos in range(c):
                assert self.pool.get(self.slot(seq, pos)) == (seq.token_ids[pos], pos), (
                    f"{seq.request_id} reads a wrong KV entry at position {pos}"
                )
            for pos in range(c, c + n):
                block = self.bm.blocks[seq.block_table[pos // self.bm.block_size]]
                assert block.ref_count == 1, "writing into a shared block"
                assert block.block_hash is None, "writing into a cached block"
                self.pool[self.slot(seq, pos)] = (seq.token_ids[pos], pos)
            done = c + n == seq.num_tokens
            token = SampledToken(synthetic_token(seq, self.vocab_size), None)
            sampled.append(token if done else None)
        updated = self.scheduler.postprocess(out, sampled)
        self.outputs.append(out)
        self.check_ref_counts()
        return out, updated

    def check(self, out: SchedulerOutput) -> None:
        """Budget, cap, coverage and uniqueness of one step's batch."""
        s = self.scheduler
        assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        assert len({id(q) for q in out.seqs}) == len(out.seqs)
        for seq, n in zip(out.seqs, out.num_scheduled_tokens, strict=True):
            assert n >= 1
            assert seq in s.running
            assert seq.num_computed_tokens + n <= seq.num_tokens
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens + n
            if not s.enable_chunked_prefill:
                assert seq.num_computed_tokens + n == seq.num_tokens
        for seq in out.preempted:
            assert seq in s.waiting and not seq.block_table
        for seq in s.running + s.waiting:
            assert seq.num_output_tokens < seq.params.max_tokens, "ran past max_tokens"
        assert s.waiting == sorted(s.waiting, key=urgency)

    def check_ref_counts(self) -> None:
        """Every block's ref count equals the number of running tables holding it."""
        expected = [0] * self.bm.num_blocks
        for seq in self.scheduler.running:
            for block_id in seq.block_table:
                expected[block_id] += 1
        for seq in self.scheduler.waiting:
            assert not seq.block_table
        assert [b.ref_count for b in self.bm.blocks] == expected
        free = set(self.bm.free_block_ids) | set(self.bm.cached_free_block_ids)
        assert len(free) == self.bm.num_free_blocks
        assert free == {i for i, n in enumerate(expected) if n == 0}

    def run(self, max_steps: int = 100_000) -> int:
        """Step until nothing is left; returns the number of steps."""
        steps = 0
        while self.scheduler.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 4096,
    chunked: bool = True,
    caching: bool = True,
    watermark: float = 0.0,
    step_time_targets: dict[int, float] | None = None,
    step_slowdowns: dict[int, float] | None = None,
    cost_model: StepCostModel | None = None,
    max_prefill_step_time: float | None = None,
    tenant_max_loss: float | None = None,
) -> Scheduler:
    """A scheduler over a fresh block manager."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids={EOS},
        enable_chunked_prefill=chunked,
        watermark=watermark,
        step_time_targets=step_time_targets,
        step_slowdowns=step_slowdowns,
        cost_model=cost_model,
        max_prefill_step_time=max_prefill_step_time,
        tenant_max_loss=tenant_max_loss,
    )


class Requests:
    """Numbers sequences in arrival order, as the engine does."""

    def __init__(self) -> None:
        self.count = 0

    def add(
        self,
        sched: Scheduler,
        prompt: list[int],
        priority: int = 0,
        deadline: float | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
        **params: Any,
    ) -> Sequence:
        """Create a sequence and put it in the scheduler's waiting line."""
        params.setdefault("ignore_eos", True)
        seq = Sequence(
            f"req-{self.count}",
            prompt,
            SamplingParams(**params),
            priority=priority,
            arrival_order=self.count,
            deadline=deadline,
            tenant=tenant,
            weight=weight,
        )
        self.count += 1
        sched.add(seq)
        return seq
