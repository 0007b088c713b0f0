"""The float16 scan serves what the float32 scan served, through real Redis.

One scope of 384-dimension entries (random ones, rows a hair either side of the bar,
duplicates stored under several job ids) is searched by two processes' caches, one
scanning in float16 and one in float32, and by the previous lookup (every row scored in
float32, ranked, the best at or above the bar served): both caches answer every query
alike, with the older entry on a tie, and as the previous lookup did wherever its
float32 score was not within float32 rounding (1e-5) of the bar or of the runner-up.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import redis

from storage.semantic_cache import SemanticEntry, SemanticMatch, unit_vector
from storage.semantic_exact import ExactSemanticCache
from storage.semantic_scan import RowScorer, exact_similarities

DIMS = 384
BAR = 0.9504  # just above a float16 value (0.950195): rows a hair above it round below it
ROUNDING = 1e-5  # float32 BLAS's own error at 384 dims is below 2.3e-5 in the worst case


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    """A client of the test Redis."""
    return redis.Redis.from_url(redis_url)


def units(rng: np.random.Generator, n: int) -> np.ndarray:
    rows = rng.standard_normal((n, DIMS)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def at_similarity(query: np.ndarray, targets: np.ndarray, rng: np.random.Generator
                  ) -> np.ndarray:
    """Rows whose similarity to `query` is each target, up to float32 rounding."""
    others = rng.standard_normal((len(targets), DIMS))
    others -= np.outer(others @ query, query)
    others /= np.linalg.norm(others, axis=1, keepdims=True)
    rows = np.outer(targets, query) + np.sqrt(1 - targets[:, None] ** 2) * others
    return rows.astype(np.float32)


def previous_pick(stored: np.ndarray, query: np.ndarray) -> tuple[int | None, bool]:
    """(row the previous float32 lookup served or None, whether its call was clear:
    no float32 score within rounding of the bar or of the winner's)."""
    scores = query[None] @ stored.T  # as the previous lookup computed them
    above = np.flatnonzero(scores[0] >= BAR)
    near_bar = np.abs(scores[0] - BAR) < ROUNDING
    if not len(above):
        return None, not near_bar.any()
    best = max(above.tolist(), key=lambda r: (scores[0, r], -r))
    rivals = np.abs(scores[0] - scores[0, best]) < ROUNDING
    rivals[best] = False
    return best, not near_bar.any() and not rivals.any()


def test_float16_and_float32_scans_serve_the_same_entries(client: redis.Redis) -> None:
    rng = np.random.default_rng(11)
    prefix, scope = f"t{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    queries = units(rng, 12)
    # One row per query a hair from the bar; three for one query, closer to each other
    # than float16 tells apart.
    gaps = [-2e-3, -3e-4, -1e-6, 0.0, 1e-6, 3e-4]
    close = [at_similarity(q, np.array([BAR + gap]), rng)
             for q, gap in zip(queries[:6], gaps, strict=True)]
    close.append(at_similarity(queries[9], BAR + np.array([1e-6, 5e-5, 2e-6]), rng))
    dupes = np.repeat(queries[6:9], 3, axis=0)  # three entries per vector: ties
    given = np.concatenate([units(rng, 2000), *close, dupes, units(rng, 500)])
    near = given[rng.integers(0, 2000, 6)] + 0.03 * units(rng, 6)
    asked = np.concatenate([queries, near])
    # What the cache keeps and searches with (each normalised once, in float32).
    stored = np.stack([unit_vector(v) for v in given])
    writer = ExactSemanticCache(client, prefix=prefix)
    writer.add_many([SemanticEntry(scope, f"j{i}", f"p{i}", v, {"i": i}, 60)
                     for i, v in enumerate(given)])
    readers = [ExactSemanticCache(client, prefix=prefix, scorer=RowScorer(half=half))
               for half in (True, False)]
    num_clear = 0
    for vector in asked:
        half_match, float_match = (r.nearest_many(scope, [vector], min_similarity=BAR)[0]
                                   for r in readers)
        query = unit_vector(vector)
        assert half_match == float_match
        exact = exact_similarities(stored, query)
        winners = np.flatnonzero(exact == exact.max())
        if exact.max() >= BAR:
            assert isinstance(half_match, SemanticMatch)
            assert half_match.job_id == f"j{winners[0]}"  # the oldest of a tie
            assert half_match.similarity == exact.max()
        else:
            assert half_match is None
        row, is_clear = previous_pick(stored, query)
        if is_clear:
            num_clear += 1
            assert (half_match.job_id if half_match else None) == (
                f"j{row}" if row is not None else None)
    assert num_clear >= 9  # the random, near and duplicate queries at least
