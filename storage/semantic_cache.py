"""Semantic cache in Redis: answers of earlier prompts, found by embedding similarity.

Responsible for what every backend shares: the scope a request searches and fills
(tenant, model, weights revision, its sampling parameters and system prompt: a prompt
only ever matches prompts asked the same way, of the same tenant), what an entry and a match are,
and the interface of a backend. Redis errors are logged and read as misses by every
backend, never raised.

Backends (`storage.semantic_backends` picks one at start-up):
- `hnsw` (`storage.semantic_hnsw`): Redis vector search (Redis 8, Redis Stack), one HNSW
  index of cosine distance over every scope, filtered by a TAG: sub-linear per lookup;
- `exact` (`storage.semantic_exact`): any Redis; each process scans a scope's vectors
  exactly with numpy, O(n) per lookup over the scope (n capped per scope).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from core import metrics
from storage.cache_ledger import LedgerReport
from storage.result_cache import canonical_request

logger = logging.getLogger(__name__)

# Bump when the scope material or a stored layout changes: old entries then miss.
SEMANTIC_CACHE_VERSION = 3
PROMPT_FIELDS = ("messages", "prompt", "cache")
# Candidates a lookup considers per query, best first (the best live one wins).
NUM_CANDIDATES = 8
KIND = "semantic"  # the cache kind in metrics, stats and the ledger


def semantic_namespace(*, tenant_id: str, model: str, revision: str | None,
                       body: dict[str, Any], system: str = "",
                       kind: str = "chat.completion") -> str:
    """The scope a request searches and fills (32 hex digits); `system` is the request's
    system prompt (a different one may well want a different answer); `kind` the result
    object (a `/v1/responses` job runs the chat body a chat call would, but its answer is
    another object)."""
    sampling = {k: v for k, v in canonical_request(body).items() if k not in PROMPT_FIELDS}
    material = {"v": SEMANTIC_CACHE_VERSION, "tenant": tenant_id, "model": model,
                "revision": revision, "sampling": sampling, "system": system}
    if kind == "response":  # other kinds differ in their bodies already
        material["kind"] = kind
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class SemanticEntry:
    """An answered prompt to remember in its scope for `ttl_s` seconds."""

    namespace: str
    job_id: str
    prompt: str
    vector: np.ndarray
    result: dict[str, Any]
    ttl_s: int


@dataclass(frozen=True, slots=True)
class SemanticMatch:
    """The most similar earlier prompt of a scope."""

    job_id: str
    prompt: str
    similarity: float
    result: dict[str, Any]


class SemanticStore(Protocol):
    """What a semantic-cache backend offers (see the module docstring)."""

    @property
    def backend(self) -> str:
        """`hnsw` or `exact`."""
        ...

    def add_many(self, entries: list[SemanticEntry]) -> None:
        """Remember answered prompts (entries with a ttl of 0 or less are skipped)."""
        ...

    def nearest_many(self, namespace: str, vectors: list[np.ndarray],
                     min_similarity: float = -1.0) -> list[SemanticMatch | None]:
        """For each vector, the most similar live earlier prompt of the scope at least
        `min_similarity` alike, or None."""
        ...


def unit_vector(vector: np.ndarray) -> np.ndarray:
    """The vector as float32 of norm 1 (a zero vector stays zero)."""
    flat = np.asarray(vector, dtype=np.float32).reshape(-1)
    norm = float(np.linalg.norm(flat))
    return flat / norm if norm > 0 else flat


def json_bytes(value: Any) -> bytes:
    """Compact UTF-8 JSON (lone surrogates kept, as the cache reads them back)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass")


def from_json_bytes(raw: bytes | str) -> Any:
    """`json_bytes` read back."""
    return json.loads(raw.decode("utf-8", "surrogatepass") if isinstance(raw, bytes) else raw)


def count_write(stored_bytes: int, reports: list[LedgerReport]) -> None:
    """Metrics of one write of either backend: bytes stored, entries it evicted, and the
    bytes the cache holds after it (the last report's)."""
    metrics.CACHE_BYTES.labels(KIND, "stored").inc(stored_bytes)
    metrics.CACHE_EVICTIONS.labels(KIND).inc(sum(r.num_evicted for r in reports))
    metrics.CACHE_RESIDENT_BYTES.labels(KIND).set(reports[-1].resident_bytes)


def count_failed_write(error: Exception, num_prompts: int) -> None:
    """A write either backend could not make: counted and logged; the prompts are simply
    not remembered (a cache outage never fails a job)."""
    metrics.CACHE_ERRORS.labels(KIND).inc()
    logger.warning("semantic cache write failed (%s); %d prompts not remembered", error,
                   num_prompts)
