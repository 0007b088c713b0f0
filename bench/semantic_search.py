"""Semantic-cache lookups at 10,000 and 100,000 entries of one scope, through our own cache.

Fills one scope (one tenant, model, revision and sampling) of the semantic cache with
random unit vectors of 384 floats (all-MiniLM-L6-v2's size), each stored with a
verifier's probe as a worker stores it, in a real Redis, then times:
- the cold lookup: a process that never searched the scope reads its vectors first;
- warm lookups one query at a time (p50, p99 over `--queries`), as a worker with one
  opted-in job per poll does, and the CPU per job of search + verify (the verifier runs
  on the candidate as `SemanticLookup` runs it: probe read, features, decision); half
  the queries are near a stored vector (a hit fetches its result), half random;
- a batch of all the queries in one call, as a worker does for a poll's jobs of a scope.

For the `exact` backend (the scan every Redis supports), both scans in one invocation,
their lookups alternated query by query so the machine's load falls on both alike:
`float32` (every row scored in float32 by numpy, as before) and `float16` (a float16
copy scanned through torch on one thread, the few rows that may win rescored exactly;
what a worker runs). Both must serve the same entries: the script says whether they did.
`--backend hnsw` times Redis vector search instead (needs the search module). Redis:
BATCHINFER_REDIS_URL (or `--redis-url`) when set, else a `redis-server` started here on
a free port and stopped after.

    .venv/bin/python -m bench.semantic_search [--entries 10000 100000 --queries 200]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch  # noqa: F401  (loaded, as a worker's engine has it: the float16 scan uses it)

from scheduler.embedded_services import free_port, redis_service
from storage.cache_policy import CachePolicy
from storage.semantic_cache import SemanticEntry, SemanticMatch, SemanticStore
from storage.semantic_exact import ExactSemanticCache
from storage.semantic_hnsw import HnswSemanticCache
from storage.semantic_scan import RowScorer
from workers.inference.semantic_lookup import SEARCH_FLOOR
from workers.inference.semantic_segments import PromptSegments, SegmentVectors
from workers.inference.semantic_verifier import Probe, accepts, features_of, load_calibration

DIMS = 384
FILL_BATCH = 1000
PHASE_PAUSE_S = 0.5
# A stand-in for the engine beside the worker's lookups (`--busy`): a loop of float32
# matrix products on torch's default threads, as a CPU decode step keeps the cores.
BUSY_LOOP = ("import torch\nx = torch.randn(512, 2048)\nw = torch.randn(2048, 2048)\n"
             "while True:\n    x = torch.tanh(x @ w)\n")


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--backend", choices=("exact", "hnsw"), default="exact")
    parser.add_argument("--busy", action="store_true",
                        help="time beside a process keeping the cores busy with torch")
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


def make_cache(client: redis.Redis, backend: str, prefix: str, entries: int,
               scorer: RowScorer | None = None) -> SemanticStore:
    """A cache of the asked backend under `prefix` (its own mirror: a fresh process)."""
    if backend == "hnsw":
        cache = HnswSemanticCache(client, prefix=prefix, dims=DIMS)
        cache.ensure_index()
        return cache
    return ExactSemanticCache(client, prefix=prefix, max_entries=max(entries, 128),
                              scorer=scorer)


def unit_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random unit vectors, (n, DIMS) float32."""
    rows = rng.standard_normal((n, DIMS), dtype=np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def percentile_ms(seconds: list[float], q: float) -> float:
    """The q-th percentile of durations, in milliseconds."""
    return float(np.percentile(np.asarray(seconds) * 1000.0, q))


def stored_result(i: int, vector: np.ndarray) -> dict[str, Any]:
    """An entry's result as a worker stores it: the answer and the verifier's probe."""
    probe = Probe.of(PromptSegments(f"bench prompt {i}", ""),
                     SegmentVectors(vector, vector, False))
    return {"answer": {"text": f"answer {i}"}, "probe": probe.to_json()}


def verified(match: SemanticMatch | None, query: np.ndarray, text: str) -> bool:
    """Whether the verifier lets the candidate serve the query (as `SemanticLookup` does
    it: read the probe, compute the features, decide under the default policy)."""
    if match is None or not isinstance(match.result, dict):
        return False
    probe = Probe.from_json(match.result["probe"])
    features = features_of(PromptSegments(text, ""), SegmentVectors(query, query, False),
                           probe)
    return accepts(CachePolicy(mode="semantic"), features, match.similarity,
                   load_calibration())


@dataclass
class Timings:
    """One cache's figures at one scope size."""

    cold_s: float = 0.0
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    picks: list[str | None] = field(default_factory=list)
    num_served: int = 0
    batch_s: float = 0.0


def fill(cache: SemanticStore, namespace: str, stored: np.ndarray) -> float:
    """Store the entries; their number per second."""
    start = time.perf_counter()
    for first in range(0, len(stored), FILL_BATCH):
        cache.add_many([
            SemanticEntry(namespace, f"job-{i}", f"bench prompt {i}", stored[i],
                          stored_result(i, stored[i]), 3600)
            for i in range(first, min(first + FILL_BATCH, len(stored)))])
    return len(stored) / (time.perf_counter() - start)


def measure(readers: dict[str, SemanticStore], namespace: str,
            queries: list[np.ndarray], texts: list[str]) -> dict[str, Timings]:
    """Cold, warm and batched lookups of each reader. Warm ones run in phases, readers in
    the order A B B A (load that drifts falls on both alike), with a pause between
    phases: numpy's BLAS threads spin for a while after a product, and that CPU would
    otherwise be charged to the other reader's lookups."""
    timings = {name: Timings() for name in readers}
    for name, reader in readers.items():
        start = time.perf_counter()
        reader.nearest_many(namespace, [queries[0]])
        timings[name].cold_s = time.perf_counter() - start
    names = list(readers)
    half = len(queries) // 2
    for phase, name in enumerate([*names, *reversed(names)]):
        time.sleep(PHASE_PAUSE_S)
        part = slice(0, half) if phase < len(names) else slice(half, None)
        for query, text in zip(queries[part], texts[part], strict=True):
            start, start_cpu = time.perf_counter(), time.process_time()
            (match,) = readers[name].nearest_many(namespace, [query],
                                                  min_similarity=SEARCH_FLOOR)
            served = verified(match, query, text)
            timings[name].cpu_s.append(time.process_time() - start_cpu)
            timings[name].wall_s.append(time.perf_counter() - start)
            timings[name].picks.append(match.job_id if match else None)
            timings[name].num_served += served
    for name, reader in readers.items():
        time.sleep(PHASE_PAUSE_S)
        start = time.perf_counter()
        reader.nearest_many(namespace, queries, min_similarity=SEARCH_FLOOR)
        timings[name].batch_s = time.perf_counter() - start
    return timings


def report(entries: int, fill_rate: float, timings: dict[str, Timings]) -> None:
    """Print one scope size's figures, the readers side by side."""
    names = list(timings)
    print(f"\n## {entries:,} entries in one scope (fill {fill_rate:,.0f} entries/s)\n")  # noqa: T201
    print("| | " + " | ".join(names) + " |")  # noqa: T201
    print("|---|" + "---|" * len(names))  # noqa: T201
    rows = [
        ("cold lookup (mirror read from Redis)", lambda t: f"{t.cold_s * 1000:.0f} ms"),
        ("warm lookup + verify, one query per call: p50",
         lambda t: f"{percentile_ms(t.wall_s, 50):.2f} ms"),
        ("warm lookup + verify: p99", lambda t: f"{percentile_ms(t.wall_s, 99):.2f} ms"),
        ("CPU per job (search + verify): mean",
         lambda t: f"{1000 * float(np.mean(t.cpu_s)):.2f} ms"),
        ("CPU per job: p50", lambda t: f"{percentile_ms(t.cpu_s, 50):.2f} ms"),
        ("served (verifier passed) / queries",
         lambda t: f"{t.num_served}/{len(t.wall_s)}"),
        ("batch of all queries in one call, per query",
         lambda t: f"{t.batch_s * 1000 / len(t.wall_s):.2f} ms"),
    ]
    for label, value in rows:
        print(f"| {label} | " + " | ".join(value(timings[n]) for n in names) + " |")  # noqa: T201
    if len(names) > 1:
        ratio = percentile_ms(timings[names[0]].wall_s, 50) / percentile_ms(
            timings[names[1]].wall_s, 50)
        same = all(timings[n].picks == timings[names[0]].picks for n in names)
        print(f"\n{names[0]} / {names[1]} warm p50: {ratio:.2f}x; "  # noqa: T201
              f"same entry picked for every query: {'yes' if same else 'NO'}")


def main() -> None:
    """Fill, then time cold, warm and batched lookups; print the figures."""
    args = parse_args()
    busy = (subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
            if args.busy else None)
    beside = ", beside a busy torch loop" if busy else ""
    print(f"# semantic_search: backend {args.backend}, {args.entries} entries of {DIMS} "  # noqa: T201
          f"floats in one scope, {args.queries} queries{beside}; "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    try:
        with redis_url(args.redis_url) as url:
            client = redis.Redis.from_url(url)
            for entries in args.entries:
                rng = np.random.default_rng(0)
                namespace = uuid.uuid4().hex
                prefix = f"bench{uuid.uuid4().hex[:8]}"
                stored = unit_rows(rng, entries)
                picked = rng.integers(0, entries, args.queries // 2)
                near = stored[picked] + 0.05 * unit_rows(rng, len(picked))  # cosine ~0.999
                queries = [*near, *unit_rows(rng, args.queries - len(near))]
                texts = [*(f"bench prompt {i}" for i in picked),
                         *(f"another question {i}" for i in range(args.queries - len(near)))]
                fill_rate = fill(make_cache(client, args.backend, prefix, entries),
                                 namespace, stored)
                if args.backend == "hnsw":
                    readers = {"hnsw": make_cache(client, "hnsw", prefix, entries)}
                else:
                    readers = {label: make_cache(client, "exact", prefix, entries,
                                                 RowScorer(half=half))
                               for label, half in (("float32 scan (before)", False),
                                                   ("float16 scan + exact rescoring", True))}
                report(entries, fill_rate, measure(readers, namespace, queries, texts))
                client.delete(*client.keys(f"{prefix}:*"))
            client.close()
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    print(f"\n# load average {os.getloadavg()[0]:.2f} at the end")  # noqa: T201


if __name__ == "__main__":
    main()
