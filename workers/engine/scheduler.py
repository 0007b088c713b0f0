"""Decides, every step, which sequences run and how many of their tokens.

Responsibilities:
- keep the waiting line ordered by priority (lower value = more urgent), then deadline
  (earliest first, none last), then the tenant's virtual start (fair share between
  tenants by weight, see tenant_clock), then arrival; a preempted sequence goes back to
  its original place in that line;
- spend a token budget (`max_num_batched_tokens`) per step under a cap of `max_num_seqs`
  running sequences, one priority level at a time, most urgent first: its decodes, its
  prefill chunks, then admissions of its waiting sequences;
- latency classes (latency_classes): once a step holds sequences of a priority with a
  target step time or a slowdown bound, less urgent work joins it only while the cost
  model predicts the step stays within them; the rest sit the step out keeping their KV
  blocks (a prefill chunk shrinks to fit first). With no urgent work in a step nothing is held
  back, so low priorities never starve for want of a target of their own;
- within a level, tenants over their weighted share of its running sequences join the
  step after those under it, within a cap bounded by their loss (`tenant_max_loss`,
  tenant_share);
- bound the prefill work of every step (`max_prefill_step_time`): a request that arrives
  while a step runs waits for that step to end, so a step of low-priority prefill
  chunks sized only by the token budget (2,048 tokens: ~25 s of SmolLM2 on a loaded
  2-core CPU) held a `normal` job back that long before its own first step. Prefill
  beyond the bound waits for the next step (the step's decodes are never held back for
  it, and an empty step still takes at least one block of prefill, so work progresses);
- chunk long prefills (or, with chunked prefill off, schedule each prefill whole);
- when KV blocks run out, preempt by recompute the least urgent, newest running sequence;
- let a strictly more urgent waiting sequence displace the least urgent running one when
  the sequence cap or the KV pool is full (equal priorities never displace each other);
- keep a free-block watermark when admitting, so running sequences rarely need preempting;
- apply sampled tokens and stop conditions, and free whatever finishes;
- on a longrope model, recompute a sequence once it outgrows the original context, so that
  every position takes the long factors (as Hugging Face re-encodes it then).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from workers.engine.block_manager import BlockManager
from workers.engine.latency_classes import LatencyClasses
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_cost import EMPTY_STEP, StepCostModel, StepShape
from workers.engine.step_draft import StepDraft
from workers.engine.tenant_clock import TenantClocks
from workers.engine.tenant_share import (
    ShareSplit,
    TenantShare,
    lost_seconds,
    running_shape,
    split_by_share,
)

logger = logging.getLogger(__name__)


class Sampled(Protocol):
    """What the model runner returns per sequence: one token and maybe its logprob."""

    @property
    def token_id(self) -> int:
        """The sampled token."""
        ...

    @property
    def logprob(self) -> float | None:
        """Its log-probability, when the request asked for it."""
        ...

    @property
    def top_logprobs(self) -> list[tuple[int, float]] | None:
        """The most likely tokens and their log-probabilities, when asked for."""
        ...


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: the sequences to run and how many tokens of each."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    # Sequences sent back to the waiting line this step (their KV was dropped).
    preempted: list[Sequence] = field(default_factory=list)
    # What the step computes, as the cost model prices it.
    shape: StepShape = EMPTY_STEP
    # Running sequences that sat this step out to keep a more urgent class on target.
    num_held_back: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens the model computes this step."""
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.seqs


def urgency(seq: Sequence) -> tuple[int, float, float, int]:
    """Sort key: most urgent first (lower priority value, earlier deadline, earlier virtual
    start of its tenant's fair share, earlier arrival)."""
    deadline = seq.deadline if seq.deadline is not None else math.inf
    return (seq.priority, deadline, seq.virtual_start, seq.arrival_order)


class Scheduler:
    """Continuous batching with chunked prefill, priorities and preemption by recompute."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int],
        enable_chunked_prefill: bool = True,
        watermark: float = 0.01,
        step_time_targets: Mapping[int, float] | None = None,
        step_slowdowns: Mapping[int, float] | None = None,
        cost_model: StepCostModel | None = None,
        kv_window: int | None = None,
        max_prefill_step_time: float | None = None,
        tenant_max_loss: float | None = None,
        rope_switch: int | None = None,
    ) -> None:
        """kv_window: the widest sliding window when every layer has one (blocks before it
        are given back as sequences advance), None when any layer attends to everything.
        max_prefill_step_time: seconds the prefill work of one step may add to it, priced
        by the cost model (None: the token budget alone sizes it).
        tenant_max_loss: the throughput tenants over their share of a priority may lose
        so that tenants under it take shorter steps (tenant_share; None: not capped).
        rope_switch: a longrope model's original_max_position_embeddings (None: not one)."""
        self.block_manager = block_manager
        self.kv_window = kv_window
        self.rope_switch = rope_switch
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.num_watermark_blocks = int(watermark * block_manager.num_blocks)
        self.latency_classes = LatencyClasses(dict(step_time_targets or {}),
                                              dict(step_slowdowns or {}))
        if max_prefill_step_time is not None and not max_prefill_step_time > 0:
            raise ValueError(f"max_prefill_step_time must be > 0, got {max_prefill_step_time}")
        self.max_prefill_step_time = max_prefill_step_time
        self.tenant_share = None if tenant_max_loss is None else TenantShare(tenant_max_loss)
        self.cost_model = cost_model if cost_model is not None else StepCostModel()
        self.num_held_back_steps = 0  # sequence-steps sat out for a latency class or tenant cap
        self.waiting: list[Sequence] = []  # sorted by urgency
        self.tenant_clocks = TenantClocks()
        # In urgency order (inserted so): a sort per step called urgency() per sequence.
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_cache_hit_tokens = 0

    def max_positions(self, seq: Sequence) -> int:
        """KV positions the sequence holds at its longest (its last token is never computed)."""
        final_len = min(seq.num_tokens + seq.params.max_tokens, self.max_model_len)
        return max(seq.num_tokens, final_len - 1)

    def add(self, seq: Sequence) -> None:
        """Put a new sequence in the waiting line; ValueError if it could never run."""
        # A preempted sequence recomputes everything it has, so its longest form must fit
        # the pool alone (and, without chunking, one step's budget) or it would never return.
        bm = self.block_manager
        longest = self.max_positions(seq)
        if bm.num_blocks_for(seq.num_tokens) > bm.num_blocks:
            raise ValueError(
                f"prompt of {seq.num_tokens} tokens exceeds the KV cache's {bm.num_blocks} "
                f"blocks of {bm.block_size} tokens"
            )
        if bm.num_blocks_for(longest) > bm.num_blocks:
            raise ValueError(
                f"max_tokens={seq.params.max_tokens} after a {seq.num_tokens}-token prompt "
                f"exceeds the KV cache's {bm.num_blocks} blocks; lower max_tokens"
            )
        if not self.enable_chunked_prefill and longest > self.max_num_batched_tokens:
            field_name = "prompt" if seq.num_tokens > self.max_num_batched_tokens else "max_tokens"
            raise ValueError(
                f"{field_name}: {longest} tokens to (re)compute exceed max_num_batched_tokens="
                f"{self.max_num_batched_tokens} with chunked prefill off"
            )
        seq.status = SequenceStatus.WAITING
        seq.rope_long = self.rope_switch is not None and seq.num_tokens > self.rope_switch
        self.tenant_clocks.stamp(seq)
        bisect.insort(self.waiting, seq, key=urgency)

    def has_unfinished(self) -> bool:
        """True while any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch within the token budget and the sequence cap."""
        step = StepDraft(self.max_num_batched_tokens)
        running = list(self.running)  # kept in urgency order; preemption changes the list
        levels = sorted({s.priority for s in running} | {s.priority for s in self.waiting})
        tenant_lost_s = 0.0
        for level in levels:
            # The tightest target among the more urgent sequences already in this step;
            # the first level present never has one, so the most urgent work always runs.
            step.cap = self.latency_classes.cap(step, self.cost_model)
            group = running if len(levels) == 1 else [s for s in running if s.priority == level]
            split = ShareSplit(group, [])
            if self.tenant_share is not None and self.cost_model.is_fitted:
                split = split_by_share(group, self.waiting, level)
            self._schedule_group(split.under, step)
            if split.over:
                tenant_lost_s += self._schedule_over_share(split, step)
            self._admit_waiting(step, max_priority=level)
            if any(s.priority == level for s in step.scheduled):
                self.latency_classes.level_scheduled(step, level, self.cost_model)
        # Every request fits the pool and the budget alone (checked in add), and the most
        # urgent level present is never capped, so with work pending something always
        # runs; an empty batch here would be a livelock.
        assert step.scheduled or not self.has_unfinished(), "scheduler stalled"
        seqs = list(step.scheduled)
        self.num_held_back_steps += step.num_held_back
        if self.tenant_share is not None and self.cost_model.is_fitted:
            self.tenant_share.settle(self.cost_model.predict(step.shape), tenant_lost_s)
        return SchedulerOutput(
            seqs,
            [step.scheduled[s] for s in seqs],
            step.preempted,
            shape=step.shape,
            num_held_back=step.num_held_back,
        )

    def _schedule_group(self, group: list[Sequence], step: StepDraft) -> None:
        """Running sequences of one level: decodes first (one token each, latency-sensitive),
        then prefill chunks."""
        decodes, chunks = [], []
        for seq in group:
            num_uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            if num_uncomputed == 1:
                decodes.append(seq)
            elif num_uncomputed > 1:
                chunks.append(seq)
        self._schedule_decodes(decodes, step)
        for seq in chunks:
            if seq.status is SequenceStatus.RUNNING and step.budget > 0:
                self._schedule_running(seq, step)

    def _schedule_over_share(self, split: ShareSplit, step: StepDraft) -> float:
        """Tenants over their share of a level: the least served sequence of each runs
        whatever the cap (the floor), then their decodes while the step is below the cap
        (the one that crosses it joins too: rounded down, two sequences of which one sat
        out lost half their rate, far beyond the loss bound), then their prefill chunks
        shrunk to fit. Returns the seconds of their throughput the step gave up."""
        assert self.tenant_share is not None
        level_cap, predict = step.cap, self.cost_model.predict
        under_s = predict(step.shape)
        full = step.shape.plus(*dataclasses.astuple(running_shape(split.over, step.budget)))
        full_s = predict(full) if level_cap is None else min(predict(full), level_cap)
        cap = self.tenant_share.cap(under_s, full_s, split.over_weight_fraction)
        self._schedule_group(split.over[:split.num_floor], step)
        rest = split.over[split.num_floor:]
        decodes = [s for s in rest if s.num_uncomputed_tokens == 1]
        a, per_token, per_kv, per_seq = self.cost_model.coefficients()
        for i, seq in enumerate(decodes):
            shape = step.shape  # predict() inlined: a numpy call per sequence costs ~5 us
            if (a + per_token * shape.num_tokens + per_kv * shape.num_kv_tokens
                    + per_seq * shape.num_seqs) >= cap:
                step.num_held_back += len(decodes) - i
                break
            self._schedule_group([seq], step)
        step.cap = cap if level_cap is None else min(cap, level_cap)
        self._schedule_group([s for s in rest if s.num_uncomputed_tokens > 1], step)
        step.cap = level_cap
        return lost_seconds(under_s, full_s, predict(step.shape))

    def _num_within_cap(self, step: StepDraft, num_context_tokens: int, num_new: int) -> int:
        """How many of `num_new` tokens fit the step's cap (all of them with no cap)."""
        if step.cap is None:
            return num_new
        fits = self.cost_model.max_new_tokens_within(step.shape, num_context_tokens, step.cap)
        return min(num_new, fits)

    def _num_prefill_within_bound(self, step: StepDraft, num_context_tokens: int,
                                  num_new: int) -> int:
        """How many of a prefill's `num_new` tokens fit `max_prefill_step_time`, priced at
        what the step's prefill adds to it (the step's fixed cost is paid anyway: counted
        here, it shrank SmolLM2's chunks to ~50 tokens on a loaded CPU, and the fixed cost
        of the many steps that followed cut a batch's throughput); at least a block (or
        all of them without chunking) while the step holds no prefill yet."""
        if self.max_prefill_step_time is None or not self.cost_model.is_fitted:
            return num_new
        seconds_per_step = self.cost_model.coefficients()[0]
        fits = self.cost_model.max_new_tokens_within(
            step.prefill_shape, num_context_tokens,
            seconds_per_step + self.max_prefill_step_time)
        if step.prefill_shape.num_seqs == 0:
            floor = self.block_manager.block_size if self.enable_chunked_prefill else num_new
            fits = max(fits, floor)
        return min(num_new, fits)

    def postprocess(self, out: SchedulerOutput, sampled: Seq[Sampled | None]) -> list[Sequence]:
        """Advance progress, append sampled tokens, apply stop conditions.

        Returns the sequences that received a token this step (finished ones included).
        """
        if len(sampled) != len(out.seqs):
            raise ValueError(f"sampled has {len(sampled)} entries for {len(out.seqs)} seqs")
        updated: list[Sequence] = []
        block_size = self.block_manager.block_size
        running = SequenceStatus.RUNNING
        rope_switch = self.rope_switch
        for seq, n, token in zip(out.seqs, out.num_scheduled_tokens, sampled, strict=True):
            if seq.status is not running:
                # Ended by a stop string (or aborted) while this step ran: the engine
                # overlaps the last step's output processing with this one. Drop its work.
                assert seq.status.is_finished
                continue
            seq.num_computed_tokens += n
            # A decode fills a block only at a block boundary; until then nothing to cache.
            if n > 1 or seq.num_computed_tokens % block_size == 0:
                self.block_manager.cache_computed_blocks(seq)
            if self.kv_window is not None:
                self.block_manager.release_out_of_window(seq, self.kv_window)
            if token is None:
                assert seq.num_computed_tokens < seq.num_tokens, "no token for a full prefill"
                continue
            assert seq.num_computed_tokens == seq.num_tokens, "token for a partial prefill"
            seq.append_token(token.token_id, token.logprob, token.top_logprobs)
            updated.append(seq)
            status = self._stop_status(seq)
            if status is not None:
                self.finish(seq, status)
            elif rope_switch is not None and not seq.rope_long and seq.num_tokens > rope_switch:
                self._recompute_long(seq)
        return updated

    def _recompute_long(self, seq: Sequence) -> None:
        """Back to the waiting line to recompute all it has with longrope's long factors
        (its KV holds the short ones); its block hashes change with the mode."""
        seq.rope_long = True
        self._requeue(seq, self.block_manager.forget)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of the engine for good and free its blocks."""
        assert status.is_finished
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = status
        self.block_manager.forget(seq)

    def _stop_status(self, seq: Sequence) -> SequenceStatus | None:
        # Runs for every sampled token: plain attribute reads, no properties.
        token_ids, params = seq.token_ids, seq.params
        token_id = token_ids[-1]
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        num_tokens = len(token_ids)
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _schedule_decodes(self, decodes: list[Sequence], step: StepDraft) -> None:
        """One token for each running decode, in order, while the budget lasts.

        A decode whose next position lies in a block it holds needs no allocation and, with
        no time cap on the step, no pricing: it is added here in a few operations (the step
        loop's hottest path at large batches); the others go through _schedule_running.
        """
        bs = self.block_manager.block_size
        caching = self.block_manager.enable_prefix_caching
        scheduled, running_status = step.scheduled, SequenceStatus.RUNNING
        num_fast = num_fast_kv = 0
        for i, seq in enumerate(decodes):
            if step.budget <= 0:
                break
            if seq.status is not running_status:
                continue  # preempted earlier in this step
            end = seq.num_computed_tokens + 1
            if step.cap is not None or end > len(seq.block_table) * bs:
                step.shape = step.shape.plus(num_fast, num_fast_kv, num_fast)
                num_fast = num_fast_kv = 0
                if step.cap is not None and not self._a_decode_fits(step):
                    # Not even a decode with no context fits: none of the rest does. Pricing
                    # each of them took ~2 us, 0.9 ms a step of a tiny model with 400
                    # sequences sitting out beside a `high` one, half its step.
                    step.num_held_back += sum(1 for s in decodes[i:]
                                              if s.status is running_status)
                    return
                self._schedule_running(seq, step)
                continue
            scheduled[seq] = 1
            step.budget -= 1
            num_fast += 1
            num_fast_kv += end
            if caching and end % bs == 0:  # this token completes a block
                step.completing_hashes.update(self.block_manager.hashes_completed_by(seq, 1))
        step.shape = step.shape.plus(num_fast, num_fast_kv, num_fast)

    def _a_decode_fits(self, step: StepDraft) -> bool:
        """Whether one more decode, of the least context, keeps the step within its cap
        (the coefficients are >= 0, so a decode with more context costs no less)."""
        assert step.cap is not None
        return self._num_within_cap(step, 0, 1) > 0

    def _schedule_running(self, seq: Sequence, step: StepDraft) -> None:
        num_new = min(seq.num_uncomputed_tokens, step.budget)
        assert num_new > 0
        if num_new < seq.num_uncomputed_tokens and not self.enable_chunked_prefill:
            return
        num_fitting = self._num_within_cap(step, seq.num_computed_tokens, num_new)
        if seq.num_uncomputed_tokens > 1:  # a prefill chunk, not a decode
            num_fitting = self._num_prefill_within_bound(step, seq.num_computed_tokens,
                                                         num_fitting)
        if num_fitting < num_new and (num_fitting == 0 or not self.enable_chunked_prefill):
            step.num_held_back += 1  # sits out, its blocks kept for the next step
            return
        num_new = num_fitting
        while not self.block_manager.append_slots(seq, num_new):
            # Out of blocks: recompute-preempt the least urgent, newest running sequence;
            # when that is `seq` itself it simply waits (no equal-priority ping-pong: a
            # readmitted sequence is still the newest, so it is the next victim again).
            victim = max(self.running, key=urgency)
            self._preempt(victim, step)
            if victim is seq:
                return
        step.add(seq, num_new, self.block_manager.hashes_completed_by(seq, num_new),
                 is_prefill=seq.num_uncomputed_tokens > 1)

    def _admit_waiting(self, step: StepDraft, *, max_priority: int) -> None:
        bm = self.block_manager
        while self.waiting and step.budget > 0:
            seq = self.waiting[0]
            if seq.priority > max_priority:
                break  # its level comes later in this step
            if seq in step.preempted:
                break  # it keeps its place in line, but does not bounce back in this step
            if len(self.running) >= self.max_num_seqs:
                if self._displace_for(seq, step, num_blocks_needed=0):
                    continue
                break
            cached = bm.find_cached_prefix(seq)
            next_hash = bm.next_block_hash(seq, len(cached))
            if next_hash is not None and next_hash in step.completing_hashes:
                # A sequence in this very step computes the next block of this prefix:
                # wait one step and share it instead of computing it twice.
                break
            num_uncached = seq.num_tokens - len(cached) * bm.block_size
            num_new = min(num_uncached, step.budget)
            if num_new < num_uncached and not self.enable_chunked_prefill:
                break
            num_new = self._num_within_cap(step, len(cached) * bm.block_size, num_new)
            num_new = self._num_prefill_within_bound(step, len(cached) * bm.block_size, num_new)
            if num_new == 0 or (num_new < num_uncached and not self.enable_chunked_prefill):
                break  # a more urgent class holds this step; admit it at a later one
            reserve = self.num_watermark_blocks if self.running else 0
            if not bm.can_admit(cached, num_new, reserve):
                needed = bm.num_blocks_for(len(cached) * bm.block_size + num_new) + reserve
                if self._displace_for(seq, step, num_blocks_needed=needed):
                    continue
                break
            bm.admit(seq, cached, num_new)
            self.waiting.pop(0)
            self.tenant_clocks.on_admit(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=urgency)
            self.num_prefix_cache_hit_tokens += seq.num_cached_tokens
            step.add(seq, num_new, bm.hashes_completed_by(seq, num_new), is_prefill=True)

    def _displace_for(self, seq: Sequence, step: StepDraft, *, num_blocks_needed: int) -> bool:
        """Preempt the least urgent running sequence if strictly less urgent than `seq`.

        With `num_blocks_needed`, only when preempting every strictly less urgent sequence
        could free enough blocks; otherwise victims would be dropped for nothing.
        """
        victims = [s for s in self.running if s.priority > seq.priority]
        if not victims:
            return False
        if num_blocks_needed:
            blocks = self.block_manager.blocks
            freeable = sum(1 for s in victims for b in s.block_table if blocks[b].ref_count == 1)
            if self.block_manager.num_free_blocks + freeable < num_blocks_needed:
                return False
        self._preempt(max(victims, key=urgency), step)
        return True

    def _preempt(self, seq: Sequence, step: StepDraft) -> None:
        logger.debug("preempting %s (priority %d)", seq.request_id, seq.priority)
        step.remove(seq)  # before free(): it resets the progress the step priced
        self._requeue(seq, self.block_manager.free)
        self.num_preemptions += 1
        step.preempted.append(seq)

    def _requeue(self, seq: Sequence, release: Callable[[Sequence], None]) -> None:
        """A running sequence back in the waiting line, its blocks released, to recompute."""
        self.running.remove(seq)
        release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=urgency)
