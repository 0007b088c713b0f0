"""Which semantic-cache backend a process uses, chosen once at start-up.

`auto` (the default) takes Redis vector search (`hnsw`) when the server has the search
module and the exact numpy scan (`exact`) otherwise; `hnsw` insists on vector search
(start-up fails without it); `exact` never asks. A server that cannot be reached at
start-up gets the exact scan, which needs nothing of it in advance, with a warning.
"""

from __future__ import annotations

import logging

import redis

from storage.semantic_cache import SemanticStore
from storage.semantic_exact import DEFAULT_MAX_ENTRIES, ExactSemanticCache
from storage.semantic_hnsw import DEFAULT_DIMS, HnswSemanticCache, has_vector_search

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "hnsw", "exact")


def open_semantic_cache(client: redis.Redis, *, prefix: str, backend: str = "auto",
                        max_entries: int = DEFAULT_MAX_ENTRIES,
                        dims: int = DEFAULT_DIMS) -> SemanticStore:
    """The backend `backend` asks for on this server (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"semantic_cache_backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "exact":
        try:
            if has_vector_search(client):
                cache = HnswSemanticCache(client, prefix=prefix, dims=dims)
                cache.ensure_index()
                logger.info("semantic cache: Redis vector search (HNSW index %s, %d dims)",
                            cache.index_name, dims)
                return cache
        except redis.RedisError as e:
            logger.warning("semantic cache: cannot ask Redis for vector search (%s); "
                           "using the exact scan", e)
        else:
            if backend == "hnsw":
                raise ValueError("semantic_cache_backend is 'hnsw' but the Redis server has "
                                 "no search module (Redis 8 or Redis Stack has it); use "
                                 "'auto' or 'exact'")
            logger.info("semantic cache: exact scan (the Redis server has no search module; "
                        "each lookup scans its scope, at most %d entries)", max_entries)
    else:
        logger.info("semantic cache: exact scan (semantic_cache_backend=exact)")
    return ExactSemanticCache(client, prefix=prefix, max_entries=max_entries)
