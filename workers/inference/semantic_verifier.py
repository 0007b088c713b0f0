"""The verifier of semantic-cache candidates: may this earlier answer serve this prompt?

Run only on the candidate the vector search returns, never over the scope. Responsible
for what each entry keeps to be verified against (`Probe`: its last turn and context,
their texts and vectors), the features of a candidate (`CandidateFeatures`), the score
they make, and the decision for a request's `cache` policy:

- `max_error` (the default, 0.01): the structured checks (`semantic_checks`) on the last
  turns and on the contexts must pass, both prompts must be of one kind (a question, or
  a conversation with earlier turns), and the score must reach the threshold calibrated
  for that kind and bound (`semantic_calibration.json`, written by
  `bench/semantic_calibrate.py`);
- `threshold` (a raw cosine, kept from before): the similarity of the search keys must
  reach it, and the structured checks must pass.

The score is the last turns' cosine, lowered where the words overlap much yet the
meaning moved (a small edit that moves the embedding far is a changed question, a
rewrite that moves it as far is a paraphrase) and where the contexts differ:

    score = last - overlap_penalty * overlap * (1 - last) - context_penalty * (1 - context)

with `overlap` the Jaccard overlap of the last turns' content words.

What `max_error` means: thresholds are set split-conformally on labelled trap pairs
(prompts near a cached one that need another answer): for each kind, the threshold
leaves at most k of the n calibration traps at or above it, with (k + 1) / (n + 1) <=
max_error, so a new trap drawn like them is served the wrong answer with probability at
most max_error. A bound tighter than the calibration set can certify (1 / (n + 1))
gets no threshold: such requests are answered by the exact cache only.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from storage.cache_policy import CachePolicy
from workers.inference.semantic_checks import STOP_WORDS, disagreements, salient
from workers.inference.semantic_segments import PromptSegments, SegmentVectors

CALIBRATION_PATH = Path(__file__).with_name("semantic_calibration.json")
KINDS = ("question", "conversation")
# No calibrated threshold below this, whatever the traps allow.
MIN_THRESHOLD = 0.8


def kind_of(has_context: bool) -> str:
    """`conversation` for a prompt with earlier turns, else `question`."""
    return "conversation" if has_context else "question"


@dataclass(frozen=True, slots=True)
class Probe:
    """What a cache entry keeps for the verifier (stored beside its answer)."""

    last: str
    context: str
    last_vector: np.ndarray
    context_vector: np.ndarray
    has_context: bool

    @classmethod
    def of(cls, segments: PromptSegments, vectors: SegmentVectors) -> Probe:
        """The probe of an answered prompt."""
        return cls(segments.last, segments.context, vectors.last, vectors.context,
                   vectors.has_context)

    def to_json(self) -> dict[str, Any]:
        """A JSON form (vectors as float16: the cosines move by under 1e-3)."""
        return {"last": self.last, "context": self.context,
                "last_vector": _pack(self.last_vector),
                "context_vector": _pack(self.context_vector) if self.has_context else None}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Probe:
        """`to_json` read back; ValueError for anything else."""
        try:
            last_vector = _unpack(raw["last_vector"])
            has_context = raw["context_vector"] is not None
            context_vector = _unpack(raw["context_vector"]) if has_context else last_vector
            return cls(str(raw["last"]), str(raw["context"]), last_vector, context_vector,
                       has_context)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a semantic-cache probe: {e}") from e


@dataclass(frozen=True, slots=True)
class CandidateFeatures:
    """What the verifier reads of a (prompt, candidate) pair."""

    last_similarity: float
    context_similarity: float
    overlap: float  # Jaccard overlap of the last turns' content words
    failed_checks: tuple[str, ...]  # structured checks failed (context ones prefixed)
    kind: str  # the prompt's: question or conversation
    same_kind: bool  # whether the candidate is of the prompt's kind


def features_of(query: PromptSegments, vectors: SegmentVectors,
                probe: Probe) -> CandidateFeatures:
    """The features of a prompt against a candidate's probe."""
    failed = disagreements(query.last, probe.last)
    if query.context or probe.context:
        failed += [f"context_{name}" for name in disagreements(query.context, probe.context)]
    mine, theirs = _content_words(query.last), _content_words(probe.last)
    overlap = len(mine & theirs) / len(mine | theirs) if mine | theirs else 1.0
    # Two prompts without earlier turns share their (empty) context whole.
    context_similarity = (float(vectors.context @ probe.context_vector)
                          if vectors.has_context and probe.has_context else 1.0)
    return CandidateFeatures(float(vectors.last @ probe.last_vector), context_similarity,
                             overlap,
                             tuple(failed), kind_of(vectors.has_context),
                             vectors.has_context == probe.has_context)


@dataclass(frozen=True, slots=True)
class Calibration:
    """The score's penalties and, per kind, thresholds by error bound (ascending)."""

    overlap_penalty: float
    context_penalty: float
    kind_to_bounds: dict[str, list[tuple[float, float | None]]]

    def score(self, f: CandidateFeatures) -> float:
        """The candidate's score (see the module docstring); -inf when a check failed."""
        if f.failed_checks or not f.same_kind:
            return float("-inf")
        return (f.last_similarity - self.overlap_penalty * f.overlap * (1 - f.last_similarity)
                - self.context_penalty * (1 - f.context_similarity))

    def threshold(self, kind: str, max_error: float) -> float | None:
        """The threshold of the largest calibrated bound <= max_error (None: none is)."""
        best = None
        for bound, threshold in self.kind_to_bounds[kind]:
            if bound <= max_error + 1e-12:
                best = threshold
        return best

    def to_json(self) -> dict[str, Any]:
        """The form `semantic_calibration.json` holds."""
        return {"overlap_penalty": self.overlap_penalty,
                "context_penalty": self.context_penalty,
                "thresholds": {kind: [[b, t] for b, t in bounds]
                               for kind, bounds in self.kind_to_bounds.items()}}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Calibration:
        """`to_json` read back."""
        return cls(float(raw["overlap_penalty"]), float(raw["context_penalty"]),
                   {kind: [(float(b), None if t is None else float(t)) for b, t in bounds]
                    for kind, bounds in raw["thresholds"].items()})


@cache
def load_calibration(path: Path = CALIBRATION_PATH) -> Calibration:
    """The calibration shipped with the worker (read once per process)."""
    return Calibration.from_json(json.loads(path.read_text(encoding="utf-8")))


def accepts(policy: CachePolicy, f: CandidateFeatures, key_similarity: float,
            calibration: Calibration) -> bool:
    """Whether the candidate may serve the prompt under the request's policy."""
    if policy.threshold is not None:
        return key_similarity >= policy.threshold and not f.failed_checks and f.same_kind
    threshold = calibration.threshold(f.kind, policy.max_error)
    return threshold is not None and calibration.score(f) >= threshold


def conformal_threshold(trap_scores: list[float], max_error: float) -> float | None:
    """The lowest threshold leaving k of the n trap scores at or above it with
    (k + 1) / (n + 1) <= max_error; None when even k = 0 is not enough. Worked example:
    n = 123 traps, max_error 0.01: (k + 1) / 124 <= 0.01 allows k = 0, so the threshold
    lies just above the highest trap; at 0.005, 1 / 124 > 0.005: None."""
    num_allowed = math.floor(max_error * (len(trap_scores) + 1) + 1e-9) - 1
    if num_allowed < 0:
        return None
    ranked = sorted((s for s in trap_scores if s > float("-inf")), reverse=True)
    if num_allowed >= len(ranked):
        return MIN_THRESHOLD
    # Just above the (num_allowed + 1)-th highest trap: num_allowed traps remain above.
    return max(MIN_THRESHOLD, float(np.nextafter(ranked[num_allowed], np.inf)))


def _content_words(text: str) -> frozenset[str]:
    return frozenset(w for w in salient(text).words if w not in STOP_WORDS)


def _pack(vector: np.ndarray) -> str:
    return base64.b64encode(np.asarray(vector, dtype=np.float16).tobytes()).decode("ascii")


def _unpack(text: str) -> np.ndarray:
    vector = np.frombuffer(base64.b64decode(text), dtype=np.float16).astype(np.float32)
    if not vector.size:
        raise ValueError("an empty vector")
    return vector
