"""One request's tokens, KV blocks and progress through the engine.

A sequence is the unit the scheduler, block manager and model runner share. It imports
nothing of the engine. Progress is measured in tokens whose K/V sit in the cache:
`num_computed_tokens` (including the ones found in the prefix cache). The scheduler decides
how many of the remaining tokens run this step; when a step computes up to `num_tokens`
the model runner samples one new token for the sequence.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING

from workers.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.engine.grammar import GrammarState


class SequenceStatus(Enum):
    """Lifecycle order: waiting → running → (preempted → waiting …) → finished_*."""

    WAITING = auto()
    RUNNING = auto()
    FINISHED_STOPPED = auto()
    FINISHED_LENGTH = auto()
    FINISHED_ABORTED = auto()

    @property
    def is_finished(self) -> bool:
        """True for every terminal status."""
        return self in _FINISHED


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
}

FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """A request inside the engine: prompt + generated tokens and their KV blocks."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_order: int = 0,
        deadline: float | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        # Kept apart as well: every output of the request carries it, and slicing it off
        # token_ids for each would copy the prompt once per generated token.
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # Lower value = more urgent (as in vLLM); ties broken by arrival_order.
        self.priority = priority
        self.arrival_order = arrival_order
        # Seconds since the epoch by which the request should finish; within a priority
        # the earliest deadline runs first, and None sorts after every deadline.
        self.deadline = deadline
        # Whose request it is (opaque to the engine) and its fair-share weight: within a
        # priority and deadline, tenants share admissions by weight (tenant_clock).
        self.tenant = tenant
        self.weight = weight
        self.virtual_start = 0.0  # set by the scheduler's TenantClocks when queued
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at the last admission (for stats).
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Longrope's long factors for every position (the sequence is longer than the
        # model's original context; set by the scheduler, read by the runner).
        self.rope_long = False
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        # With params.prompt_logprobs: per prompt position, the log-probability of its token
        # given those before it (position 0 has none), and the alternatives; filled as
        # prefill chunks run (a recompute after preemption does not add them again).
        self.prompt_logprobs: list[float | None] = [None]
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] = [None]
        # The grammar its output must follow (`params.json_schema`), set by the engine.
        self.grammar: GrammarState | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens, in order."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        """The most recent token (the input of the next decode step)."""
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are not yet in the cache."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once the sequence has left the engine for good."""
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason, or None while unfinished. A document the token
        budget closed (grammar_budget) ended for its length, not the model's choice."""
        closed = self.grammar is not None and self.grammar.closed_early
        if closed and self.status is SequenceStatus.FINISHED_STOPPED:
            return "length"
        return FINISH_REASON.get(self.status)

    def append_token(self, token_id: int, logprob: float | None = None,
                     top_logprobs: list[tuple[int, float]] | None = None) -> None:
        """Record one sampled token (and what the request asked to know of its step)."""
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
