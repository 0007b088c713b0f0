"""The semantic cache on Redis vector search (Redis 8, Redis Stack): one HNSW index.

Responsible for: telling whether a server has the search module (`has_vector_search`),
creating the index once (every worker tries; "already exists" is fine), storing each
answered prompt as one hash document with its own TTL, finding a query's nearest
documents of its scope with `FT.SEARCH ... KNN` through redis-py's
`redis.commands.search`, and keeping the cache's ledger (`storage.cache_ledger`).

Layout: documents `<prefix>:semdoc:<dims>:<namespace>:<job id>`, hashes of
    ns        the scope (TAG: a query only ever sees its own scope)
    vec       float32 unit vector (VECTOR HNSW, FLOAT32, DIM <dims>, COSINE)
    job_id, prompt, result (JSON), expires_at
indexed by `<prefix>:sem:hnsw:<dims>` (ON HASH, PREFIX the documents' prefix). Redis
drops a document at its TTL and the index with it; `expires_at` guards the moment
between. Cost per lookup: one FT.SEARCH, sub-linear in the scope's size (HNSW).
The cosine distance the index returns is 1 - similarity.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import numpy as np
import redis
from redis.commands.search.field import TagField, VectorField
from redis.commands.search.index_definition import IndexDefinition, IndexType
from redis.commands.search.query import Query

from core import metrics
from storage import redis_scripts
from storage.cache_ledger import CacheLedger, LedgerChange
from storage.semantic_cache import (
    KIND,
    NUM_CANDIDATES,
    SemanticEntry,
    SemanticMatch,
    count_failed_write,
    count_write,
    from_json_bytes,
    json_bytes,
    unit_vector,
)

logger = logging.getLogger(__name__)

DEFAULT_DIMS = 384  # all-MiniLM-L6-v2
# Names `MODULE LIST` gives the search module: Redis 8 and Stack say "search", RediSearch
# 1.x said "ft".
SEARCH_MODULE_NAMES = frozenset({"search", "ft", "searchlight"})
_NAMESPACE = re.compile(r"[0-9a-f]+")  # semantic_namespace's hex: no TAG escaping needed
# A search that finds no index tries to create it again, at most this often.
RECREATE_INTERVAL_S = 30.0


def has_vector_search(client: redis.Redis) -> bool:
    """Whether the server answers FT commands: its `MODULE LIST` names the search module,
    or (MODULE refused, e.g. by an ACL, or search built in unlisted) `FT._LIST` works.
    RedisError other than a refused command propagates."""
    try:
        modules = client.module_list()
    except redis.ResponseError:
        modules = []
    names = {_text(module.get(b"name", module.get("name", b""))).lower() for module in modules}
    if names & SEARCH_MODULE_NAMES:
        return True
    try:
        client.execute_command("FT._LIST")
    except redis.ResponseError:
        return False
    return True


def index_fields(dims: int) -> list[Any]:
    """The index's schema: the scope as a TAG, the vector as HNSW over cosine distance."""
    return [TagField("ns"),
            VectorField("vec", "HNSW", {"TYPE": "FLOAT32", "DIM": dims,
                                        "DISTANCE_METRIC": "COSINE"})]  # fmt: skip


def knn_query(namespace: str, k: int = NUM_CANDIDATES) -> Query:
    """The `k` documents of a scope nearest to the vector passed as parameter `vec`."""
    if not _NAMESPACE.fullmatch(namespace):
        raise ValueError(f"namespace must be lowercase hex, got {namespace!r}")
    return (Query(f"(@ns:{{{namespace}}})=>[KNN {k} @vec $vec AS distance]")
            .sort_by("distance")
            .return_fields("distance", "job_id", "prompt", "expires_at")
            .return_field("result", decode_field=False)
            .paging(0, k)
            .dialect(2))  # fmt: skip


class HnswSemanticCache:
    """The `hnsw` semantic-cache backend (see the module docstring)."""

    backend = "hnsw"

    def __init__(self, client: redis.Redis, *, prefix: str, dims: int = DEFAULT_DIMS) -> None:
        if dims < 1:
            raise ValueError(f"dims must be >= 1, got {dims}")
        self._redis = client
        self.dims = dims
        self.index_name = f"{prefix}:sem:hnsw:{dims}"
        self.doc_prefix = f"{prefix}:semdoc:{dims}:"
        self.ledger = CacheLedger(client, prefix=prefix, kind=KIND)
        self._next_recreate_at = 0.0

    def ensure_index(self) -> None:
        """Create the index unless it exists; RedisError propagates."""
        definition = IndexDefinition(prefix=[self.doc_prefix], index_type=IndexType.HASH)
        try:
            self._redis.ft(self.index_name).create_index(index_fields(self.dims),
                                                         definition=definition)
        except redis.ResponseError as e:
            if "already exists" not in str(e).lower():
                raise
        else:
            logger.info("semantic cache: created HNSW index %s", self.index_name)

    def _recreate_index(self) -> None:
        """Create the index again if it is gone, at most every `RECREATE_INTERVAL_S`."""
        now = time.monotonic()
        if now < self._next_recreate_at:
            return
        self._next_recreate_at = now + RECREATE_INTERVAL_S
        try:
            self.ensure_index()
        except redis.RedisError as e:
            logger.warning("semantic cache: cannot create the HNSW index again (%s)", e)

    def doc_key(self, namespace: str, job_id: str) -> str:
        """The Redis key of one answered prompt's document."""
        return f"{self.doc_prefix}{namespace}:{job_id}"

    def add_many(self, entries: list[SemanticEntry]) -> None:
        """Store one document per entry (with its TTL) and the ledger, in one round trip."""
        now = time.time()
        pipe = self._redis.pipeline(transaction=False)
        changes = []
        for entry in entries:
            vector = unit_vector(entry.vector)
            if entry.ttl_s <= 0:
                continue
            if vector.size != self.dims:
                logger.warning("semantic cache: a %d-d vector does not fit the %d-d index; "
                               "not remembered", vector.size, self.dims)
                continue
            vec, prompt = vector.tobytes(), entry.prompt.encode("utf-8", "surrogatepass")
            result = json_bytes(entry.result)
            key = self.doc_key(entry.namespace, entry.job_id)
            pipe.hset(key, mapping={"ns": entry.namespace, "vec": vec, "job_id": entry.job_id,
                                    "prompt": prompt, "result": result,
                                    "expires_at": now + entry.ttl_s})
            pipe.expire(key, entry.ttl_s)
            num_bytes = len(vec) + len(prompt) + len(result)
            changes.append(LedgerChange("set", key.removeprefix(self.doc_prefix), num_bytes,
                                        1, entry.ttl_s))
        if not changes:
            return
        self.ledger.queue(pipe, changes)
        try:
            report = self.ledger.report(redis_scripts.execute(pipe)[-1])
        except redis.RedisError as e:
            count_failed_write(e, len(changes))
            return
        count_write(sum(c.num_bytes for c in changes), [report])

    def nearest_many(self, namespace: str, vectors: list[np.ndarray],
                     min_similarity: float = -1.0) -> list[SemanticMatch | None]:
        """Per vector, the most similar live document of the scope at least
        `min_similarity` alike, or None: one FT.SEARCH each."""
        query = knn_query(namespace)
        matches: list[SemanticMatch | None] = []
        for vector in vectors:
            unit = unit_vector(vector)
            if unit.size != self.dims:
                matches.append(None)
                continue
            try:
                found = self._redis.ft(self.index_name).search(
                    query, query_params={"vec": unit.tobytes()})
            except redis.RedisError as e:
                metrics.CACHE_ERRORS.labels(KIND).inc()
                logger.warning("semantic cache search failed (%s); treating as a miss", e)
                if "index" in str(e).lower() and isinstance(e, redis.ResponseError):
                    self._recreate_index()  # e.g. a restarted Redis without persistence
                matches.append(None)
                continue
            matches.append(self._best(_documents(found), min_similarity))
        return matches

    @staticmethod
    def _best(docs: list[dict[str, Any]], min_similarity: float) -> SemanticMatch | None:
        """The first live document at least `min_similarity` alike (docs come best first)."""
        now = time.time()
        for doc in docs:
            similarity = 1.0 - float(doc["distance"])
            if similarity < min_similarity:
                return None
            if float(doc["expires_at"]) < now:
                continue
            metrics.CACHE_BYTES.labels(KIND, "loaded").inc(len(doc["result"]))
            return SemanticMatch(_text(doc["job_id"]), _text(doc["prompt"]), similarity,
                                 from_json_bytes(doc["result"]))
        return None


def _documents(found: Any) -> list[dict[str, Any]]:
    """The returned fields of each document of an FT.SEARCH answer: redis-py's `Result`
    (its default), or the RESP3 map a client made with `protocol=3` keeps."""
    if isinstance(found, dict):
        return [{_text(k): v for k, v in (item.get("extra_attributes") or {}).items()}
                for item in found.get("results", [])]
    return [vars(doc) for doc in found.docs]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
