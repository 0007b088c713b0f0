"""What the engine hands back: per-request outputs and engine-wide statistics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock milestones of one request (seconds since the epoch)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to the end."""
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """One request's state after a step: everything so far plus what is new this step."""

    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    text: str  # all generated text so far (stop strings trimmed)
    token_ids: list[int]  # all generated tokens so far
    delta_text: str  # text new since this request's previous output
    delta_token_ids: list[int]  # tokens new since this request's previous output
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    logprobs: list[float] | None  # of each generated token, when asked for
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    metrics: RequestMetrics
    # Per generated token, its step's `top_logprobs` most likely (token id, logprob).
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With `prompt_logprobs`: per prompt token, its log-probability given the tokens
    # before it (None for the first) and the alternatives there.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt (for usage accounting)."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (for usage accounting)."""
        return len(self.token_ids)


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's load and its totals since start."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    num_prefix_cache_hit_tokens: int
    num_preemptions: int
    num_computed_tokens: int  # tokens the model ran on (prefill chunks and decodes)
    num_generated_tokens: int
    busy_seconds: float  # time spent inside step()
    # Sequence-steps that running sequences sat out to keep a more urgent class on target.
    num_held_back_steps: int = 0
    num_steps: int = 0  # steps that ran a batch
    # Wall time while requests were live: busy_seconds plus the caller's time between
    # steps (outputs handed on, requests taken in). A worker's service rate: on the tiny
    # model tokens per busy second ran 12% above what the worker got through.
    loaded_seconds: float = 0.0
    # The work its live requests have left (what a finish-time estimate needs), if each
    # runs to its max_tokens (a stop or EOS may end it sooner): tokens the model will
    # compute (prompts not prefilled yet, KV recomputed after a preemption, then one per
    # output token but the last), and of those, tokens still to be generated.
    num_requests_left: int = 0
    num_tokens_to_compute: int = 0
    # How long the steps for that work should take, by the fitted step cost and the
    # steps the engine's batch width needs (see work_left); None until the cost is fitted.
    predicted_seconds_left: float | None = None
    num_output_tokens_left: int = 0
    # A decode step of one of those requests alone, by the fitted step cost (None until
    # it is fitted or while nothing is left).
    solo_step_seconds: float | None = None
    # Tokens per second of a full batch of jobs shaped as the recently finished ones, by
    # the fitted step cost (see work_left): the pace for new work while it holds none.
    full_batch_tokens_per_s: float | None = None

    @property
    def tokens_per_s(self) -> float:
        """Tokens the model ran on per busy second."""
        return self.num_computed_tokens / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def generation_tokens_per_s(self) -> float:
        """Generated tokens per busy second."""
        return self.num_generated_tokens / self.busy_seconds if self.busy_seconds else 0.0
