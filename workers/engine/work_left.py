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
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from workers.engine.sequence import Sequence as Seq
from workers.engine.sequence import SequenceStatus


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
                   coefficients: tuple[float, float, float, float] | None) -> dict[str, Any]:
    """`EngineStats`' work-left fields, summed over live sequences given as (sequence,
    whether it was ever scheduled). One not scheduled yet is expected to find
    `cached_share` of its prompt in the prefix cache, as the admitted ones did; with
    `coefficients` (a fitted step cost) the seconds left are predicted too, and the
    seconds of a decode step that runs one of them alone (what a job that outlasts the
    others waits per token)."""
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
    return {"num_requests_left": num_requests, "num_tokens_to_compute": num_to_compute,
            "num_output_tokens_left": num_output_left,
            "predicted_seconds_left": predicted, "solo_step_seconds": solo_step}
