"""Semantic-cache lookups at 100,000 entries of one scope, through the project's own cache.

Fills one scope (one tenant, model, revision and sampling) of the semantic cache with
random unit vectors of 384 floats (all-MiniLM-L6-v2's size) in a real Redis, then times:
- the cold lookup: a process that never searched the scope reads its vectors first;
- warm lookups one query at a time (p50, p99 over `--queries`), as a worker with one
  opted-in job per poll does; half the queries are near a stored vector (a hit fetches
  its result), half random;
- a batch of all the queries in one call, as a worker does for a poll's jobs of a scope.

Backend: `exact` (the numpy scan every Redis supports) unless `--backend hnsw`, which
needs a Redis with the search module. Redis: BATCHINFER_REDIS_URL (or `--redis-url`) when
set, else a `redis-server` started here on a free port and stopped after.

    .venv/bin/python -m bench.semantic_search [--entries 100000 --queries 200 --backend exact]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import redis

from scheduler.embedded_services import free_port, redis_service
from storage.semantic_cache import SemanticEntry, SemanticStore
from storage.semantic_exact import ExactSemanticCache
from storage.semantic_hnsw import HnswSemanticCache

DIMS = 384
FILL_BATCH = 1000


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--backend", choices=("exact", "hnsw"), default="exact")
    parser.add_argument("--redis-url", default=os.environ.get("BATCHINFER_REDIS_URL", ""))
    return parser.parse_args()


@contextmanager
def redis_url(given: str) -> Iterator[str]:
    """`given`, or a throwaway redis-server's URL."""
    if given:
        yield given
        return
    port = free_port()
    with tempfile.TemporaryDirectory() as data_dir, redis_service(
            port=port, data_dir=Path(data_dir), persist=False, prefer_system=True):
        yield f"redis://127.0.0.1:{port}/0"


def make_cache(client: redis.Redis, backend: str, prefix: str, entries: int) -> SemanticStore:
    """A cache of the asked backend under `prefix` (its own mirror: a fresh process)."""
    if backend == "hnsw":
        cache = HnswSemanticCache(client, prefix=prefix, dims=DIMS)
        cache.ensure_index()
        return cache
    return ExactSemanticCache(client, prefix=prefix, max_entries=max(entries, 128))


def unit_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random unit vectors, (n, DIMS) float32."""
    rows = rng.standard_normal((n, DIMS), dtype=np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def percentile_ms(seconds: list[float], q: float) -> float:
    """The q-th percentile of durations, in milliseconds."""
    return float(np.percentile(np.asarray(seconds) * 1000.0, q))


def main() -> None:
    """Fill, then time cold, warm and batched lookups; print the figures."""
    args = parse_args()
    rng = np.random.default_rng(0)
    namespace = uuid.uuid4().hex
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    stored = unit_rows(rng, args.entries)
    near = stored[rng.integers(0, args.entries, args.queries // 2)]
    near = near + 0.05 * unit_rows(rng, len(near))  # cosine ~0.999 to a stored vector
    queries = [*near, *unit_rows(rng, args.queries - len(near))]
    print(f"# semantic_search: backend {args.backend}, {args.entries} entries of {DIMS} "  # noqa: T201
          f"floats in one scope, {args.queries} queries; load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    with redis_url(args.redis_url) as url:
        client = redis.Redis.from_url(url)
        writer = make_cache(client, args.backend, prefix, args.entries)
        start = time.perf_counter()
        for first in range(0, args.entries, FILL_BATCH):
            writer.add_many([
                SemanticEntry(namespace, f"job-{i}", f"bench prompt {i}", stored[i],
                              {"text": f"answer {i}"}, 3600)
                for i in range(first, min(first + FILL_BATCH, args.entries))])
        fill_s = time.perf_counter() - start
        reader = make_cache(client, args.backend, prefix, args.entries)
        start = time.perf_counter()
        reader.nearest_many(namespace, [queries[0]])
        cold_s = time.perf_counter() - start
        warm, num_hits = [], 0
        for query in queries:
            start = time.perf_counter()
            (match,) = reader.nearest_many(namespace, [query], min_similarity=0.95)
            warm.append(time.perf_counter() - start)
            num_hits += match is not None
        start = time.perf_counter()
        reader.nearest_many(namespace, queries, min_similarity=0.95)
        batch_s = time.perf_counter() - start
        client.close()
    print(f"fill: {args.entries / fill_s:,.0f} entries/s ({fill_s:.1f} s)")  # noqa: T201
    print(f"cold lookup (mirror read from Redis): {cold_s * 1000:.0f} ms")  # noqa: T201
    print(f"warm lookup, one query per call: p50 {percentile_ms(warm, 50):.1f} ms, "  # noqa: T201
          f"p99 {percentile_ms(warm, 99):.1f} ms ({num_hits}/{len(queries)} hits)")
    print(f"batch of {len(queries)} queries in one call: {batch_s * 1000:.0f} ms "  # noqa: T201
          f"({batch_s * 1000 / len(queries):.2f} ms per query)")
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")  # noqa: T201


if __name__ == "__main__":
    main()
