"""Scoring a scope's rows against queries: a cheap approximate pass, then exact rescoring.

Responsible for: the approximate similarity of every row to each query, with a proven
bound on its error (`RowScorer`: a float16 copy of the rows through torch, on one thread,
in a process that runs torch anyway; else the float32 rows through numpy), picking from
it every row that may be among a query's `k` best at least `min_similarity` alike,
rescoring those exactly, and ranking them (`best_rows`).

The exact similarity, the only one any decision reads: the float64 sum of the products
of the float32 unit vectors' components (each product is exact in float64; numpy sums
a row's products in one fixed pairwise order, so a row scores the same whatever other
rows are scored beside it, and whether a poll brings one query or fifty). Ties go to
the older row.

Why no row is missed: every approximate score is within `eps` of the exact one. Let A
be the k-th best approximate score. The k rows scoring >= A approximately score >= A -
eps exactly, so the k-th best exact score is >= A - eps, and any row among the k best
exactly scores >= A - 2 eps approximately. A row at least m alike exactly scores >= m -
eps approximately. So the rows at or above both bars hold the exact answer. Example, k 1,
eps 0.002: approximate scores 0.951, 0.948, 0.90 with m 0.95 keep the first two (both >=
0.948 and >= 0.947); the exact scores (say 0.9495 and 0.9502) then pick the second.

Error bound of the float16 pass, for unit vectors of d components (u = 2^-11, float16's
unit roundoff): rounding query and row to float16 moves each product by at most (2u +
u^2) |q_i v_i| plus 2^-25 (|q_i| + |v_i|) where a value falls in float16's subnormal
range: at most 2u + u^2 + 2^-24 sqrt(d) in all (Cauchy-Schwarz). The products of two
float16 are exact in float32; torch sums them in float32 on the CPU (unless
`allow_fp16_reduced_precision_reduction` is set: then the float32 pass is used), at
most d 2^-24. Rounding the sum to float16 adds at most u. At d = 384: 9.8e-4 + 1.2e-6 +
2.3e-5 + 4.9e-4 = 1.49e-3; the bound used is a quarter above that.
"""

from __future__ import annotations

import math
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

# float16's unit roundoff.
HALF_ROUNDOFF = 2.0**-11
# Margin over the proven bounds (each is already a worst case).
BOUND_MARGIN = 1.25
# Queries of one call scanned in float16 one by one at most; more go through one float32
# matrix product (on this CPU torch's float16 matrix-matrix product is 10-30x slower than
# the float32 one, while its matrix-vector product is ~2x faster: it reads half the bytes).
MAX_HALF_QUERIES = 2


def half_error_bound(dims: int) -> float:
    """Largest gap between a float16 pass's similarity and the exact one (module doc)."""
    u = HALF_ROUNDOFF
    return BOUND_MARGIN * (2 * u + u * u + math.sqrt(dims) * 2.0**-24 + dims * 2.0**-24 + u)


def float_error_bound(dims: int) -> float:
    """Largest gap between a float32 BLAS pass's similarity and the exact one: the
    inputs are exact, the sum of d products errs by at most d 2^-24 of the sum of their
    magnitudes (<= 1 for unit vectors)."""
    return BOUND_MARGIN * dims * 2.0**-24 * 1.01


def exact_similarities(rows: np.ndarray, query: np.ndarray) -> np.ndarray:
    """(len(rows),) float64 exact similarities of float32 `rows` (m, d) to `query` (d,)."""
    return (rows.astype(np.float64) * query.astype(np.float64)).sum(axis=1)


class RowScorer:
    """How a process scores every row of a scope approximately: when `half`, through
    torch on a single thread of its own, so the scan never holds a second core from the
    engine beside it (float16 for one or two queries, else float32); else float32
    through numpy's BLAS (which spreads over every core: a process without an engine)."""

    def __init__(self, *, half: bool) -> None:
        self.half = half
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def for_process(cls) -> RowScorer:
        """float16 where torch is already loaded (a worker's engine runs it), else float32:
        a process without torch does not load it for the cache."""
        torch = sys.modules.get("torch")
        return cls(half=torch is not None
                   and not torch._C._get_cpu_allow_fp16_reduced_precision_reduction())

    def scores(self, queries: np.ndarray, rows: np.ndarray,
               half_rows: np.ndarray | None) -> tuple[np.ndarray, float]:
        """(approximate similarities (q, n) float32, their error bound) of unit `queries`
        (q, d) to `rows` (n, d) float32, read from `half_rows` (their float16 copy)
        where given and the call is small enough to gain from it."""
        dims = queries.shape[1]
        if not self.half:
            return queries @ rows.T, float_error_bound(dims)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="semantic-scan",
                                            initializer=_one_torch_thread)
        if half_rows is None or len(queries) > MAX_HALF_QUERIES:
            scores = self._pool.submit(_float_scores, queries, rows).result()
            return scores, float_error_bound(dims)
        scores = self._pool.submit(_half_scores, queries, half_rows).result()
        return scores, half_error_bound(dims)

    def close(self) -> None:
        """Stop the scan thread (a later scan starts another)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _one_torch_thread() -> None:
    # torch's (OpenMP's) thread count is per OS thread: this sets the scan thread's only.
    import torch

    torch.set_num_threads(1)


def _half_scores(queries: np.ndarray, half_rows: np.ndarray) -> np.ndarray:
    """(q, n) float32 similarities from one float16 matrix-vector product per query."""
    import torch

    matrix: Any = torch.from_numpy(half_rows)  # no copy: the mirror's own buffer
    with torch.inference_mode():
        return np.stack([torch.mv(matrix, torch.from_numpy(q.astype(np.float16))).numpy()
                         for q in queries]).astype(np.float32)


def _float_scores(queries: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """(q, n) float32 similarities from one float32 matrix product."""
    import torch

    with torch.inference_mode():
        result: np.ndarray = torch.mm(torch.from_numpy(np.ascontiguousarray(queries)),
                                      torch.from_numpy(rows).T).numpy()
    return result


def best_rows(queries: np.ndarray, rows: np.ndarray, half_rows: np.ndarray | None,
              scorer: RowScorer, k: int,
              min_similarity: float = -1.0) -> list[list[tuple[int, float]]]:
    """Per query (a row of `queries`, unit vectors): its at most `k` most similar rows at
    least `min_similarity` alike (-1: no bar), best first, as (row position, exact
    similarity); ties go to the lower position."""
    if k < 1 or not len(rows):
        return [[] for _ in range(len(queries))]
    approximate, eps = scorer.scores(queries, rows, half_rows)
    best = []
    for query, row_scores in zip(queries, approximate, strict=True):
        # Rows that may reach the bar (a high bar leaves few: one comparison finds them,
        # no partial sort of every row).
        candidates = np.flatnonzero(row_scores >= min_similarity - eps)
        if len(candidates) > k:  # and that may be among the k best
            kth = np.partition(row_scores[candidates], len(candidates) - k)[-k]
            candidates = candidates[row_scores[candidates] >= kth - 2 * eps]
        exact = exact_similarities(rows[candidates], query)
        if min_similarity > -1.0:
            kept = exact >= min_similarity
            candidates, exact = candidates[kept], exact[kept]
        order = np.lexsort((candidates, -exact))[:k]  # best first; ties: lower row
        best.append([(int(candidates[i]), float(exact[i])) for i in order])
    return best
