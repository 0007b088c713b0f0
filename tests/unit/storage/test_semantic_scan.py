"""The approximate scan with exact rescoring picks what a full exact scan picks.

The reference here is the spec: every row scored exactly (`exact_similarities` over the
whole scope), the bar applied, ranked best first with ties to the older row. Both
scorers (float16 through torch, float32 through numpy) must return exactly its rows and
similarities, on random scopes and on adversarial ones: rows a hair either side of the
bar (closer than float16 can tell apart), duplicates (ties), more near-ties than k, and
scopes smaller than k.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.semantic_mirror import BYTES_OBJECT_OVERHEAD, ScopeMirror
from storage.semantic_scan import (
    RowScorer,
    best_rows,
    exact_similarities,
    float_error_bound,
    half_error_bound,
)

DIMS = 384
SCORERS = [RowScorer(half=False), RowScorer(half=True)]


def units(rng: np.random.Generator, n: int, dims: int = DIMS) -> np.ndarray:
    rows = rng.standard_normal((n, dims)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def at_similarity(query: np.ndarray, targets: list[float], rng: np.random.Generator
                  ) -> np.ndarray:
    """Rows whose similarity to `query` is each target, up to float32 rounding."""
    rows = []
    for target in targets:
        other = rng.standard_normal(len(query))
        other -= other @ query * query  # orthogonal to the query
        other /= np.linalg.norm(other)
        rows.append(target * query.astype(np.float64) + np.sqrt(1 - target**2) * other)
    return np.asarray(rows, dtype=np.float32)


def reference(queries: np.ndarray, rows: np.ndarray, k: int,
              min_similarity: float) -> list[list[tuple[int, float]]]:
    """The full exact scan (the behaviour the fast path must reproduce)."""
    best = []
    for query in queries:
        exact = exact_similarities(rows, query)
        order = np.lexsort((np.arange(len(rows)), -exact))  # best first; ties: older
        best.append([(int(r), float(exact[r])) for r in order[:k]
                     if min_similarity <= -1.0 or exact[r] >= min_similarity])
    return best


def mirror_of(rows: np.ndarray, *, half: bool) -> ScopeMirror:
    mirror = ScopeMirror(b"e", 0, rows.shape[1], half=half)
    mirror.append(rows, [b"{}"] * len(rows))
    return mirror


def check_same_as_reference(queries: np.ndarray, rows: np.ndarray) -> None:
    mirrors = {s.half: mirror_of(rows, half=s.half) for s in SCORERS}
    for k in (1, 8):
        for bar in (-1.0, 0.0, 0.75, 0.95):
            expected = reference(queries, rows, k, bar)
            for scorer in SCORERS:
                got = mirrors[scorer.half].best_rows(queries, k, bar, scorer)
                assert got == expected, (scorer.half, k, bar)


def test_random_scopes_pick_what_the_exact_scan_picks() -> None:
    rng = np.random.default_rng(1)
    rows = units(rng, 3000)
    near = rows[rng.integers(0, len(rows), 6)] + 0.05 * units(rng, 6)
    queries = np.concatenate([near / np.linalg.norm(near, axis=1, keepdims=True),
                              units(rng, 4)])
    check_same_as_reference(queries[:1], rows)  # one query: the float16 pass
    check_same_as_reference(queries, rows)  # a poll's many: the float32 pass


# Bars just above a float16 value: rows a hair above them round below them in float16.
@pytest.mark.parametrize("bar", [0.75, 0.95, float(np.float16(0.8)) + 1e-4,
                                 float(np.float16(0.95)) + 2e-4])
def test_rows_a_hair_either_side_of_the_bar(bar: float) -> None:
    rng = np.random.default_rng(2)
    query = units(rng, 1)[0]
    gaps = [0.0, 1e-7, -1e-7, 1e-6, -1e-6, 1e-5, -1e-5, 3e-4, -3e-4, 1e-3, -1e-3, 2e-3, -2e-3]
    close = at_similarity(query, [bar + g for g in gaps], rng)
    rows = np.concatenate([units(rng, 500), close, units(rng, 500)])
    check_same_as_reference(query[None], rows)
    exact = exact_similarities(close, query)
    for scorer in SCORERS:
        got = best_rows(query[None], rows, rows.astype(np.float16), scorer, 64, bar)[0]
        # Exactly the rows at or above the bar, and their exact similarities.
        assert sorted(row - 500 for row, _ in got) == sorted(np.flatnonzero(exact >= bar))
        assert all(similarity >= bar for _, similarity in got)


def test_ties_go_to_the_older_row_even_beyond_k() -> None:
    rng = np.random.default_rng(3)
    rows = units(rng, 400)
    query = rows[17].copy()
    for position in (5, 90, 200, 230, 301, 350, 360, 370, 380, 399):
        rows[position] = rows[17]  # eleven identical rows: more ties than k
    for scorer in SCORERS:
        got = best_rows(query[None], rows, rows.astype(np.float16), scorer, 8, 0.9)[0]
        assert [row for row, _ in got] == [5, 17, 90, 200, 230, 301, 350, 360]
        assert len({similarity for _, similarity in got}) == 1
    check_same_as_reference(query[None], rows)


@pytest.mark.parametrize("spread", [1e-5, 4e-4])
def test_many_rows_within_the_error_bound_of_each_other(spread: float) -> None:
    """More than k rows closer to each other than the float16 pass can tell apart (its
    order among them is not the exact one): the rescoring still finds the reference's."""
    rng = np.random.default_rng(4)
    query = units(rng, 1)[0]
    targets = list(0.96 + spread * rng.standard_normal(40))
    rows = np.concatenate([units(rng, 300), at_similarity(query, targets, rng)])
    check_same_as_reference(query[None], rows)


@pytest.mark.parametrize("num_rows", [0, 1, 3, 7])
def test_scopes_smaller_than_k(num_rows: int) -> None:
    rng = np.random.default_rng(5)
    rows = units(rng, 10)[:num_rows]
    query = rows[0] if num_rows else units(rng, 1)[0]
    for scorer in SCORERS:
        got = best_rows(query[None], rows, rows.astype(np.float16), scorer, 8, -1.0)[0]
        assert got == reference(query[None], rows, 8, -1.0)[0]
        assert len(got) == num_rows


def test_the_error_bounds_hold_on_adversarial_vectors() -> None:
    """Equal components (a float16 running sum would drift by ~0.1 here), components in
    float16's subnormal range, and random ones: every approximate score stays within
    its bound."""
    rng = np.random.default_rng(6)
    flat = np.full((1, DIMS), 1 / np.sqrt(DIMS), dtype=np.float32)
    tiny = np.zeros((1, DIMS), dtype=np.float32)
    tiny[0, :300] = 3e-6  # subnormal in float16
    tiny[0, 300:] = 1.0
    tiny /= np.linalg.norm(tiny)
    rows = np.concatenate([flat, tiny, units(rng, 2000)])
    queries = np.concatenate([flat, tiny, units(rng, 2)])
    exact = np.stack([exact_similarities(rows, q) for q in queries])
    for scorer, queries_per_call in ((RowScorer(half=True), 1), (RowScorer(half=True), 4),
                                     (RowScorer(half=False), 4)):
        for first in range(0, len(queries), queries_per_call):
            part = queries[first : first + queries_per_call]
            scores, bound = scorer.scores(part, rows, rows.astype(np.float16))
            gap = np.abs(scores.astype(np.float64) - exact[first : first + len(part)])
            assert gap.max() <= bound
    assert float_error_bound(DIMS) < 1e-4 < half_error_bound(DIMS) < 2e-3


def test_the_float16_scan_leaves_the_callers_torch_threads_alone() -> None:
    before = torch.get_num_threads()
    rng = np.random.default_rng(7)
    rows = units(rng, 100)
    scorer = RowScorer(half=True)
    try:
        best_rows(rows[:1], rows, rows.astype(np.float16), scorer, 1)
        assert torch.get_num_threads() == before
    finally:
        scorer.close()


def test_a_half_mirror_keeps_its_float16_copy_through_growth_and_trims() -> None:
    rng = np.random.default_rng(8)
    rows = units(rng, 3000, dims=16)
    mirror = ScopeMirror(b"e", 0, 16, half=True)
    for first in range(0, 3000, 700):  # several doublings
        mirror.append(rows[first : first + 700], [b"{}"] * len(rows[first : first + 700]))
    mirror.drop_head(1000)
    half = mirror.half_vectors
    assert half is not None
    assert np.array_equal(half, rows[1000:].astype(np.float16))
    assert np.array_equal(mirror.vectors, rows[1000:])
    plain = mirror_of(rows, half=False)
    assert plain.half_vectors is None
    # The budget counts the copy: 4 + 2 bytes per component per row of capacity.
    meta_bytes = len(mirror) * (len(b"{}") + BYTES_OBJECT_OVERHEAD)
    assert mirror.num_bytes == mirror.capacity * 16 * (4 + 2) + meta_bytes
    assert plain.num_bytes == plain.capacity * 16 * 4 + len(plain) * (2 + BYTES_OBJECT_OVERHEAD)


class WorstCaseScorer(RowScorer):
    """An approximate pass as wrong as its bound allows, where it hurts most: the
    exact best rows scored `bound` too low, every other row `bound` too high."""

    def __init__(self, bound: float) -> None:
        super().__init__(half=False)
        self.bound = bound

    def scores(self, queries: np.ndarray, rows: np.ndarray,
               half_rows: np.ndarray | None) -> tuple[np.ndarray, float]:
        exact = np.stack([exact_similarities(rows, q) for q in queries])
        top = exact >= np.sort(exact, axis=1)[:, -8:-7]
        return np.where(top, exact - self.bound, exact + self.bound), self.bound


@pytest.mark.parametrize("bound", [1e-3, 2e-2])
def test_no_row_is_missed_by_a_pass_off_by_its_whole_bound(bound: float) -> None:
    rng = np.random.default_rng(9)
    query = units(rng, 1)[0]
    targets = list(0.9 + 3 * bound * rng.random(60)) + [0.95, 0.95 + bound, 0.95 - bound]
    rows = np.concatenate([units(rng, 200), at_similarity(query, targets, rng)])
    scorer = WorstCaseScorer(bound)
    for k in (1, 8):
        for bar in (-1.0, 0.9, 0.95):
            assert (best_rows(query[None], rows, None, scorer, k, bar)
                    == reference(query[None], rows, k, bar))


def test_a_process_without_torch_scans_in_float32_and_does_not_load_it() -> None:
    """The API and other processes without an engine keep numpy's scan: the cache never
    loads torch for them."""
    probe = ("import sys; from storage.semantic_scan import RowScorer; "
             "print(RowScorer.for_process().half, 'torch' in sys.modules)")
    without = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).parents[3])
    assert without.stdout.split() == ["False", "False"]
    assert RowScorer.for_process().half  # this process has torch (imported above)
