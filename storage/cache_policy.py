"""A request's `cache` field: which caches may answer it, for how long, how alike is alike.

    "cache": {"mode": "auto" | "off" | "exact" | "semantic", "ttl": 3600, "threshold": 0.97}

- `auto` (the default): the exact-result cache, for deterministic requests (greedy or
  seeded); `exact` says the same explicitly;
- `semantic`: the exact cache first, then the nearest earlier prompt of the same tenant,
  model, weights and sampling parameters whose embedding is at least `threshold` alike
  (cosine) and passes the false-hit guard (`workers.inference.semantic_guard`);
- `off`: no cache reads this request, and its result fills none: neither result cache,
  nor the engine's prefix cache, nor the Redis KV tier (its prompt is computed whole, and
  its blocks are left for no one).

`ttl` (seconds) is how long this request's result is kept for others; `threshold` only
matters to `semantic`. Validation of the field happens at the API (core.requests); here a
body from the queue is read leniently (a missing or odd field means the defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODES = ("auto", "off", "exact", "semantic")
# Cosine similarity a semantic match needs by default: high, so paraphrases match and
# mere neighbours do not (the guard refuses what the embedding blurs).
DEFAULT_SEMANTIC_THRESHOLD = 0.95


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """How the caches treat one request (see the module docstring)."""

    mode: str = "auto"
    ttl_s: int | None = None
    threshold: float = DEFAULT_SEMANTIC_THRESHOLD

    @classmethod
    def of(cls, body: dict[str, Any]) -> CachePolicy:
        """The policy a request body asks for; the defaults for anything missing."""
        raw = body.get("cache")
        if not isinstance(raw, dict):
            return cls()
        mode = str(raw.get("mode")) if raw.get("mode") in MODES else "auto"
        ttl = raw.get("ttl")
        threshold = raw.get("threshold")
        return cls(
            mode=mode,
            ttl_s=ttl if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > 0 else None,
            threshold=float(threshold) if isinstance(threshold, int | float)
            and not isinstance(threshold, bool) else DEFAULT_SEMANTIC_THRESHOLD,
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
