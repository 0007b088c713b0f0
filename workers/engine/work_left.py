"""How long the engine needs for the requests it holds, from its fitted step cost.

A step costs `a + b * tokens + c * kv_tokens + d * num_seqs` (step_cost). Summed over the
steps that finish every live request, three terms do not depend on how the requests are
grouped into steps: each token the model computes costs `b` once, each KV position read
`c` once, each sequence-step `d` once. Only the fixed cost per step, `a`, does: the engine
runs at most `max_num_seqs` sequences a step, so requests beyond that wait for a slot and
a narrow tail of steps runs after the full ones. On a CPU that term is what makes a wave's
tail slower per token than its body (SmolLM2: 1.55 s a step of 256 sequences, about
0.5 s a step of 40), and what a pace measured over a mix of widths gets wrong.

The number of steps is the makespan of running each request's remaining outputs (one
step per output token) on `max_num_seqs` slots, the running requests first and the
waiting ones in the order given as slots free up.

An engine holding nothing has no work to price, but new work still needs a pace: a
batch's lines, or a deadline check at its creation. What a full batch of jobs shaped as
the last finished ones would run at (`full_batch_tokens_per_s`) is that pace; the one
measured over the last work was the pace of whatever ran last, often a wave's narrow
tail (bench/eta_accuracy.py: a batch's first estimate +54-82% late; an 8,000-line batch
with a 1-minute window refused at an estimated 339 s, which then took seconds).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.engine.sequence import Sequence as Seq
from workers.engine.sequence import SequenceStatus

# Finished requests over which the shape of a typical one is averaged (exponentially).
SHAPE_WINDOW = 64


@dataclass(slots=True)
class FinishedShape:
    """What the engine's recently finished requests were, on average: their prompts, the
    part of them computed (not found in the prefix cache), and their outputs."""

    prompt_tokens: float = 0.0
    computed_prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    num_finished: int = 0

    def add(self, *, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        """Count one finished request."""
        self.num_finished += 1
        weight = max(1.0 / self.num_finished, 1.0 / SHAPE_WINDOW)
        computed = max(1, prompt_tokens - cached_tokens)
        self.prompt_tokens += weight * (prompt_tokens - self.prompt_tokens)
        self.computed_prompt_tokens += weight * (computed - self.computed_prompt_tokens)
        self.output_tokens += weight * (output_tokens - self.output_tokens)


def full_batch_tokens_per_s(shape: FinishedShape, *, max_num_seqs: int,
                            coefficients: tuple[float, float, float, float]) -> float | None:
    """Tokens per second of a long run of jobs shaped as `shape`, `max_num_seqs` at a time,
    by the fitted step cost; None before any request finished.

    Per job: its computed prompt and every output but the last, one step share per output
    token (each step serves `max_num_seqs` jobs), its context read once per output.

    Example: prompts 40 (20 computed), 8 out, 256 slots, a = 0.1 s, b = 0.5 ms, c = 0,
    d = 0.1 ms: per job 27 tokens in 8 x 0.1 / 256 + 27 x 0.0005 + 8 x 0.0001 = 17.4 ms,
    so 1,550 tokens/s.
    """
    if shape.num_finished == 0:
        return None
    per_step, per_token, per_kv, per_seq = coefficients
    outputs = max(1.0, shape.output_tokens)
    tokens = shape.computed_prompt_tokens + outputs - 1
    kv_reads = outputs * shape.prompt_tokens + outputs * (outputs - 1) / 2
    seconds = (per_step * outputs / max_num_seqs + per_token * tokens + per_kv * kv_reads
               + per_seq * outputs)
    return tokens / seconds if seconds > 0 and tokens > 0 else None


def num_steps_left(running_outputs: Sequence[int], waiting_outputs: Sequence[int],
                   max_num_seqs: int) -> int:
    """Steps until every request has produced its outputs: `running_outputs` hold slots
    now, `waiting_outputs` take the first slot that frees, in order.

    Example: slots 2, running [3, 1], waiting [2, 2]: the first waiting starts at step 1
    (ends 3), the second at 3 (ends 5): 5 steps.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    ends = sorted(running_outputs)[-max_num_seqs:]
    ends += [0] * (max_num_seqs - len(ends))
    heapq.heapify(ends)
    for outputs in waiting_outputs:
        heapq.heapreplace(ends, ends[0] + outputs)
    return max(ends)


def seconds_left(*, num_steps: int, num_tokens: int, num_kv_reads: int, num_seq_steps: int,
                 coefficients: tuple[float, float, float, float]) -> float:
    """Seconds for `num_steps` steps computing `num_tokens` tokens, reading `num_kv_reads`
    KV positions, over `num_seq_steps` sequence-steps (step_cost's coefficients)."""
    per_step, per_token, per_kv, per_seq = coefficients
    return (per_step * num_steps + per_token * num_tokens + per_kv * num_kv_reads
            + per_seq * num_seq_steps)


def live_work_left(seqs: Sequence[tuple[Seq, bool]], *, cached_share: float,
                   max_model_len: int, max_num_seqs: int,
                   coefficients: tuple[float, float, float, float] | None,
                   finished: FinishedShape | None = None) -> dict[str, Any]:
    """`EngineStats`' work-left fields, summed over live sequences given as (sequence,
    whether it was ever scheduled). One not scheduled yet is expected to find
    `cached_share` of its prompt in the prefix cache, as the admitted ones did; with
    `coefficients` (a fitted step cost) the seconds left are predicted too, and the
    seconds of a decode step that runs one of them alone (what a job that outlasts the
    others waits per token), and with `finished` the pace of a full batch of jobs shaped
    as the finished ones."""
    num_requests = num_to_compute = num_output_left = num_kv_reads = 0
    running_outputs: list[int] = []
    waiting_outputs: list[int] = []
    for seq, was_scheduled in seqs:
        if seq.is_finished:
            continue
        num_tokens = seq.num_tokens
        output_left = max(0, min(seq.params.max_tokens - seq.num_output_tokens,
                                 max_model_len - num_tokens))
        # Uncomputed tokens (at least the last sampled one while decoding) run once
        # more, then each output token but the last is fed back in.
        num_uncomputed = num_tokens - seq.num_computed_tokens
        if not was_scheduled:  # the last token always runs
            num_uncomputed -= min(int(cached_share * num_tokens), num_tokens - 1)
        num_requests += 1
        num_to_compute += num_uncomputed + max(0, output_left - 1)
        num_output_left += output_left
        # Its remaining steps read its context, one position more each step.
        num_kv_reads += output_left * num_tokens + output_left * (output_left - 1) // 2
        is_running = seq.status == SequenceStatus.RUNNING
        (running_outputs if is_running else waiting_outputs).append(output_left)
    predicted: float | None = None
    solo_step: float | None = None
    if coefficients is not None and num_requests:
        predicted = seconds_left(
            num_steps=num_steps_left(running_outputs, waiting_outputs, max_num_seqs),
            num_tokens=num_to_compute, num_kv_reads=num_kv_reads,
            num_seq_steps=num_output_left, coefficients=coefficients)
        if num_output_left:
            # A step of one sequence, reading the mean context of the steps left.
            solo_step = seconds_left(num_steps=1, num_tokens=1,
                                     num_kv_reads=round(num_kv_reads / num_output_left),
                                     num_seq_steps=1, coefficients=coefficients)
    full_batch = (full_batch_tokens_per_s(finished, max_num_seqs=max_num_seqs,
                                          coefficients=coefficients)
                  if coefficients is not None and finished is not None else None)
    return {"num_requests_left": num_requests, "num_tokens_to_compute": num_to_compute,
            "num_output_tokens_left": num_output_left,
            "predicted_seconds_left": predicted, "solo_step_seconds": solo_step,
            "full_batch_tokens_per_s": full_batch}
