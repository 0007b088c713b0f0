"""A request's `cache` field: which caches may answer it, for how long, how alike is alike.

    "cache": {"mode": "auto" | "off" | "exact" | "semantic", "ttl": 3600,
              "max_error": 0.01}          # or "threshold": 0.97, not both

- `auto` (the default): the exact-result cache, for deterministic requests (greedy or
  seeded); `exact` says the same explicitly;
- `semantic`: the exact cache first, then the nearest earlier prompt of the same tenant,
  model, weights, sampling parameters and system prompt, if the verifier
  (`workers.inference.semantic_verifier`) lets it serve: by default with at most
  `max_error` chance (0.01) that a prompt needing another answer gets this one, as
  calibrated on labelled pairs; or, given a raw `threshold`, when the embeddings are at
  least that alike (cosine) and the structured checks pass;
- `off`: no cache reads this request, and its result fills none: neither result cache,
  nor the engine's prefix cache, nor the Redis KV tier (its prompt is computed whole, and
  its blocks are left for no one).

`ttl` (seconds) is how long this request's result is kept for others; `max_error` and
`threshold` only matter to `semantic`. Validation of the field happens at the API
(core.requests); here a body from the queue is read leniently (a missing or odd field
means the defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODES = ("auto", "off", "exact", "semantic")
# The chance of a wrong semantic answer a request accepts unless it says otherwise.
DEFAULT_MAX_ERROR = 0.01
MIN_MAX_ERROR, MAX_MAX_ERROR = 0.0001, 0.5


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """How the caches treat one request (see the module docstring)."""

    mode: str = "auto"
    ttl_s: int | None = None
    threshold: float | None = None  # a raw cosine, in place of max_error
    max_error: float = DEFAULT_MAX_ERROR

    @classmethod
    def of(cls, body: dict[str, Any]) -> CachePolicy:
        """The policy a request body asks for; the defaults for anything missing."""
        raw = body.get("cache")
        if not isinstance(raw, dict):
            return cls()
        mode = str(raw.get("mode")) if raw.get("mode") in MODES else "auto"
        ttl = raw.get("ttl")
        max_error = _number(raw.get("max_error"))
        return cls(
            mode=mode,
            ttl_s=ttl if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > 0 else None,
            threshold=_number(raw.get("threshold")),
            max_error=max_error if max_error is not None
            and MIN_MAX_ERROR <= max_error <= MAX_MAX_ERROR else DEFAULT_MAX_ERROR,
        )

    @property
    def reads_exact(self) -> bool:
        """Whether the exact-result cache may answer."""
        return self.mode != "off"

    @property
    def reads_semantic(self) -> bool:
        """Whether a semantically near earlier answer may answer."""
        return self.mode == "semantic"

    @property
    def shares_prefix_kv(self) -> bool:
        """Whether the engine's prefix cache and the KV tier may serve and keep its blocks."""
        return self.mode != "off"

    @property
    def fills(self) -> bool:
        """Whether this request's result may answer later ones."""
        return self.mode != "off"

    def ttl_or(self, default_s: int) -> int:
        """Seconds this request's result is kept: its own ttl, else the default."""
        return self.ttl_s if self.ttl_s is not None else default_s


def _number(value: Any) -> float | None:
    """A JSON number as a float; None for anything else."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None
