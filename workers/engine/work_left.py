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
