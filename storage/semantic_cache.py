"""Semantic cache in Redis: answers of earlier prompts, found by embedding similarity.

Responsible for: the namespace a request searches (tenant, model, weights revision and
its sampling parameters: a prompt only ever matches prompts asked the same way, of the
same tenant), storing an answered prompt's unit vector, text and result, and finding the
most similar earlier prompt of a namespace. Redis errors are logged and read as a miss.

Layout, per namespace `ns` (all three expire together, refreshed by each write, and each
entry also carries its own expiry, checked on a hit):

    <prefix>:sem:<ns>:vec   list of float32 unit vectors (RPUSH)
    <prefix>:sem:<ns>:meta  list of {"job_id", "prompt", "expires_at"}, same order
    <prefix>:sem:<ns>:res   hash job_id → result JSON

Search without a vector index (the embedded Redis, Debian's 7.0): each process keeps a
mirror of the namespaces it searched (a numpy matrix) and fetches only the entries added
since its last look (LLEN, then LRANGE from where it stopped), so a search costs one
round trip plus a matrix-vector product: about 10 ms at 100,000 entries of 384 floats on
one CPU core. Servers with vector search (Redis 8, Redis Stack) could index the same
vectors with HNSW; this module does not use it yet.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis

from storage.result_cache import canonical_request

logger = logging.getLogger(__name__)

# Bump when the namespace material or the stored layout changes: old entries then miss.
SEMANTIC_CACHE_VERSION = 1
PROMPT_FIELDS = ("messages", "prompt", "cache")


def semantic_namespace(*, tenant_id: str, model: str, revision: str | None,
                       body: dict[str, Any]) -> str:
    """The namespace a request searches and fills (hex digest)."""
    sampling = {k: v for k, v in canonical_request(body).items() if k not in PROMPT_FIELDS}
    material = {"v": SEMANTIC_CACHE_VERSION, "tenant": tenant_id, "model": model,
                "revision": revision, "sampling": sampling}
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class SemanticMatch:
    """The most similar earlier prompt of a namespace."""

    job_id: str
    prompt: str
    similarity: float
    result: dict[str, Any]


@dataclass(slots=True)
class _Mirror:
    vectors: np.ndarray  # (n, dims) float32, unit rows
    metas: list[dict[str, Any]] = field(default_factory=list)


class SemanticCache:
    """Stores and searches answered prompts by embedding (see the module docstring)."""

    def __init__(self, redis_client: redis.Redis, *, prefix: str) -> None:
        self._redis = redis_client
        self._prefix = prefix
        self._lock = threading.Lock()
        self._mirrors: dict[str, _Mirror] = {}

    def _key(self, namespace: str, part: str) -> str:
        return f"{self._prefix}:sem:{namespace}:{part}"

    def add(self, namespace: str, *, job_id: str, prompt: str, vector: np.ndarray,
            result: dict[str, Any], ttl_s: int) -> None:
        """Remember an answered prompt for `ttl_s` seconds."""
        if ttl_s <= 0:
            return
        unit = _unit(vector)
        meta = {"job_id": job_id, "prompt": prompt, "expires_at": time.time() + ttl_s}
        pipe = self._redis.pipeline(transaction=True)
        pipe.rpush(self._key(namespace, "vec"), unit.tobytes())
        pipe.rpush(self._key(namespace, "meta"),
                   json.dumps(meta, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        pipe.hset(self._key(namespace, "res"), job_id,
                  json.dumps(result, separators=(",", ":"), ensure_ascii=False)
                  .encode("utf-8", "surrogatepass"))
        for part in ("vec", "meta", "res"):
            pipe.expire(self._key(namespace, part), ttl_s)
        try:
            pipe.execute()
        except redis.RedisError as e:
            logger.warning("semantic cache write failed (%s); prompt not remembered", e)

    def nearest(self, namespace: str, vector: np.ndarray) -> SemanticMatch | None:
        """The most similar live earlier prompt of the namespace, or None."""
        try:
            mirror = self._synced(namespace)
        except redis.RedisError as e:
            logger.warning("semantic cache read failed (%s); treating as a miss", e)
            return None
        if mirror is None or not len(mirror.metas):
            return None
        similarities = mirror.vectors @ _unit(vector)
        now = time.time()
        for index in np.argsort(-similarities)[:8]:  # the best live one among the top few
            meta = mirror.metas[int(index)]
            if meta["expires_at"] < now:
                continue
            try:
                raw = self._redis.hget(self._key(namespace, "res"), meta["job_id"])
            except redis.RedisError as e:
                logger.warning("semantic cache read failed (%s); treating as a miss", e)
                return None
            if raw is None:
                continue
            return SemanticMatch(meta["job_id"], meta["prompt"], float(similarities[index]),
                                 json.loads(raw))
        return None

    def _synced(self, namespace: str) -> _Mirror | None:
        """The namespace's mirror, brought up to date with what others added since."""
        vec_key, meta_key = self._key(namespace, "vec"), self._key(namespace, "meta")
        with self._lock:
            mirror = self._mirrors.get(namespace)
        have = 0 if mirror is None else len(mirror.metas)
        length = int(self._redis.llen(vec_key))
        if length < have:  # the namespace expired and started over
            mirror, have = None, 0
        if length == have:
            return mirror
        pipe = self._redis.pipeline(transaction=False)
        pipe.lrange(vec_key, have, length - 1)
        pipe.lrange(meta_key, have, length - 1)
        raw_vectors, raw_metas = pipe.execute()
        count = min(len(raw_vectors), len(raw_metas))
        if count == 0:
            return mirror
        added = np.frombuffer(b"".join(raw_vectors[:count]), dtype=np.float32)
        added = added.reshape(count, -1)
        metas = [json.loads(raw) for raw in raw_metas[:count]]
        with self._lock:
            if mirror is None or mirror.vectors.shape[1] != added.shape[1]:
                mirror = _Mirror(added.copy(), metas)
            else:
                mirror = _Mirror(np.concatenate([mirror.vectors, added]), mirror.metas + metas)
            self._mirrors[namespace] = mirror
        return mirror


def _unit(vector: np.ndarray) -> np.ndarray:
    flat = np.asarray(vector, dtype=np.float32).reshape(-1)
    norm = float(np.linalg.norm(flat))
    return flat / norm if norm > 0 else flat
