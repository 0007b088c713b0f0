"""The labelled pairs of the semantic cache, read and embedded as the worker embeds them.

Shared by `bench.semantic_calibrate` (fits the verifier's calibration on the
`calibration` split) and `bench.semantic_precision` (measures every split). A pair is a
prompt `a` asked after `b` was answered: each side goes through the worker's own
segmenting and embedding (`workers.inference.semantic_segments`), `b` becomes the probe
its cache entry would hold, and the verifier's features are computed exactly as in a
lookup. The scope check (same system prompt) is made too: a pair whose system prompts
differ could never meet in the cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.cache_policy import CachePolicy
from workers.inference.semantic_segments import SegmentEmbedder, segments_of
from workers.inference.semantic_verifier import (
    Calibration,
    CandidateFeatures,
    Probe,
    accepts,
    features_of,
)

PAIRS_PATH = Path(__file__).resolve().parent.parent / "tests" / "data" / "semantic_pairs.jsonl"


@dataclass(frozen=True, slots=True)
class ScoredPair:
    """One labelled pair and what the verifier reads of it."""

    pair: dict[str, Any]
    features: CandidateFeatures
    key_similarity: float
    same_scope: bool

    @property
    def kind(self) -> str:
        """question or conversation."""
        return str(self.pair["kind"])

    @property
    def should_hit(self) -> bool:
        """Whether b's answer is right for a."""
        return bool(self.pair["hit"])

    def served(self, policy: CachePolicy, calibration: Calibration) -> bool:
        """Whether a worker would serve b's answer to a under `policy`."""
        return self.same_scope and accepts(policy, self.features, self.key_similarity,
                                           calibration)


def read_pairs(path: Path = PAIRS_PATH) -> list[dict[str, Any]]:
    """The labelled pairs (see bench/semantic_pairs_build.py)."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def score_pairs(pairs: list[dict[str, Any]], runner: Any) -> list[ScoredPair]:
    """Every pair embedded and featurised as a worker's lookup would."""
    embedder = SegmentEmbedder(runner)
    asked = [segments_of(p["a"]) for p in pairs]
    cached = [segments_of(p["b"]) for p in pairs]
    vectors = embedder.embed(asked + cached)
    asked_vectors, cached_vectors = vectors[:len(pairs)], vectors[len(pairs):]
    scored = []
    for pair, a, b, va, vb in zip(pairs, asked, cached, asked_vectors, cached_vectors,
                                  strict=True):
        features = features_of(a, va, Probe.of(b, vb))
        scored.append(ScoredPair(pair, features, float(va.search_key @ vb.search_key),
                                 a.system == b.system))
    return scored
