"""The batch one scheduling pass assembles: what it holds, what it costs, what is left.

Responsibilities: the token budget left, the sequences scheduled (in batch order) and
those preempted, the step's shape as the cost model prices it (and its prefill part
alone), the hashes of blocks it completes, the priority levels it holds and the time cap
they impose. Taking a sequence back (a preemption later in the pass) undoes its part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.sequence import Sequence
from workers.engine.step_cost import EMPTY_STEP, StepShape


@dataclass(slots=True)
class StepDraft:
    """The batch being assembled in one `Scheduler.schedule()` call."""

    budget: int
    scheduled: dict[Sequence, int] = field(default_factory=dict)  # in batch order
    preempted: list[Sequence] = field(default_factory=list)
    # Hashes of blocks this step completes, so an admission can wait to share them.
    completing_hashes: set[bytes] = field(default_factory=set)
    shape: StepShape = EMPTY_STEP
    # Priority levels with a sequence in this step, and the time cap they impose.
    levels_scheduled: set[int] = field(default_factory=set)
    cap: float | None = None
    # Caps set by levels with a slowdown bound: that many times the step's cost once the
    # level (and every more urgent one) was in it.
    slowdown_caps: list[float] = field(default_factory=list)
    num_held_back: int = 0
    # The prefill chunks of this step alone, priced against `max_prefill_step_time`
    # (a chunk of a sequence preempted later in the step stays counted: the bound errs
    # on the short side).
    prefill_shape: StepShape = EMPTY_STEP

    def add(self, seq: Sequence, num_new_tokens: int, completed: list[bytes], *,
            is_prefill: bool = False) -> None:
        """Schedule `num_new_tokens` of `seq`."""
        self.scheduled[seq] = num_new_tokens
        self.budget -= num_new_tokens
        self.completing_hashes.update(completed)
        # Attention reads every position up to the last new one.
        kv = seq.num_computed_tokens + num_new_tokens
        self.shape = self.shape.plus(num_new_tokens, kv)
        if is_prefill:
            self.prefill_shape = self.prefill_shape.plus(num_new_tokens, kv)

    def remove(self, seq: Sequence) -> None:
        """Take back a sequence scheduled earlier in this step (it was preempted)."""
        num_new_tokens = self.scheduled.pop(seq, None)
        if num_new_tokens is None:
            return
        self.budget += num_new_tokens
        kv = seq.num_computed_tokens + num_new_tokens
        self.shape = self.shape.plus(-num_new_tokens, -kv, -1)
