"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.greedy import GREEDY_TEMPERATURE

# The most alternatives per position a request may ask for (OpenAI's bound).
MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    `temperature` 0, or any below GREEDY_TEMPERATURE, means greedy (a `seed` then
    changes nothing). `seed` makes sampling reproducible whatever else shares the batch.
    `logprobs` asks for the log-probability of every sampled token, and `top_logprobs`
    (with it, up to MAX_TOP_LOGPROBS) for that many of the most likely tokens at each step.
    `prompt_logprobs` (0 to MAX_TOP_LOGPROBS) asks for each prompt token's log-probability
    given the tokens before it (the model's, before any sampling adjustment), and that
    many alternatives; such a request computes its whole prompt (no prefix cache).
    Penalties and `logit_bias` (token id -> bias) adjust the logits as OpenAI's do;
    `json_schema` (JSON text) constrains the output to documents the schema accepts;
    `structural_tag` (xgrammar's structural tag, JSON text) constrains the parts of a free
    text it delimits, e.g. tool calls after their trigger.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    # Tenants sharing a worker can be kept out of each other's prefix cache.
    cache_salt: str | None = None
    # False: this request neither reuses cached prefix blocks (pool or KV tier) nor
    # leaves its own blocks for others; it computes its whole prompt.
    use_prefix_cache: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    json_schema: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        k = self.top_logprobs
        if not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        pk = self.prompt_logprobs
        if pk is not None and not (isinstance(pk, int) and not isinstance(pk, bool)
                                   and 0 <= pk <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {pk!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.json_schema is not None and self.structural_tag is not None:
            raise ValueError("json_schema and structural_tag cannot both constrain one output")
        if not isinstance(self.use_prefix_cache, bool):
            raise ValueError(f"use_prefix_cache must be a bool, got {self.use_prefix_cache!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when the tokens generated so far change the next token's logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0
