"""ScopeMirror and MirrorSet: rows in Redis's order, appends without O(n) copies each,
trimmed heads, the best rows per query, and a byte budget over all mirrors."""

from __future__ import annotations

import numpy as np
import pytest

from storage.semantic_mirror import MIN_CAPACITY, MirrorSet, ScopeMirror


def units(rng: np.random.Generator, n: int, dims: int = 8) -> np.ndarray:
    """n random unit rows."""
    rows = rng.standard_normal((n, dims)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def metas(first: int, n: int) -> list[bytes]:
    """Raw meta JSON naming entries first..first+n-1."""
    return [b'{"job_id": "j%d"}' % i for i in range(first, first + n)]


def test_rows_keep_their_absolute_indices_through_appends_and_trims() -> None:
    rng = np.random.default_rng(0)
    rows = units(rng, 3000)
    mirror = ScopeMirror(b"e1", 40, 8)
    mirror.append(rows[:1000], metas(40, 1000))
    buffer = mirror.vectors.base
    mirror.append(rows[1000:1500], metas(1040, 500))
    assert mirror.vectors.base is buffer  # room was there: no copy
    mirror.drop_head(300)  # absolute 40..339 trimmed
    assert (mirror.start, mirror.end, len(mirror)) == (340, 1540, 1200)
    np.testing.assert_array_equal(mirror.vectors, rows[300:1500])
    assert mirror.meta(0) == {"job_id": "j340"}
    mirror.append(rows[1500:3000], metas(1540, 1500))
    np.testing.assert_array_equal(mirror.vectors, rows[300:3000])
    assert mirror.meta(len(mirror) - 1) == {"job_id": "j3039"}


def test_reserve_then_append_copies_nothing_and_chunks_can_start_mid_way() -> None:
    """Chunks as Redis keeps them (vectors back to back, metas joined by newlines); the
    first `skip` entries of the first chunk are ones the mirror already holds."""
    rng = np.random.default_rng(1)
    rows = units(rng, 10)
    mirror = ScopeMirror(b"e", 0, 8)
    mirror.reserve(5000)
    assert mirror.capacity >= 5000
    mirror.append(rows[:3], metas(0, 3))
    chunks = [rows[0:4].tobytes(), rows[4:8].tobytes(), rows[8:10].tobytes()]
    meta_chunks = [b"\n".join(metas(0, 4)), b"\n".join(metas(4, 4)), b"\n".join(metas(8, 2))]
    mirror.append_chunks(chunks, meta_chunks, skip=3)
    np.testing.assert_array_equal(mirror.vectors, rows)
    assert [mirror.meta(i)["job_id"] for i in range(10)] == [f"j{i}" for i in range(10)]
    with pytest.raises(ValueError, match="vector bytes"):
        mirror.append_chunks([rows[:2].tobytes()], [b"\n".join(metas(10, 3))])


def test_growth_is_geometric() -> None:
    mirror = ScopeMirror(b"e", 0, 4)
    capacities = set()
    for _ in range(5000):
        mirror.append(np.ones((1, 4), np.float32), [b"{}"])
        capacities.add(mirror.capacity)
    assert min(capacities) == MIN_CAPACITY and len(capacities) <= 4


def test_best_rows_are_ranked_and_a_bar_drops_the_rest() -> None:
    """Query 0 is row 5 itself; query 1 is far from all but row 2; query 2 from all."""
    rng = np.random.default_rng(2)
    rows = units(rng, 50)
    mirror = ScopeMirror(b"e", 0, 8)
    mirror.append(rows, metas(0, 50))
    far = -rows.mean(axis=0)
    queries = np.stack([rows[5], rows[2] * 0.98 + units(rng, 1)[0] * 0.02,
                        far / np.linalg.norm(far)])
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    top = mirror.best_rows(queries, 3)
    assert [len(t) for t in top] == [3, 3, 3]
    assert top[0][0][0] == 5 and top[0][0][1] == pytest.approx(1.0, abs=1e-5)
    assert top[1][0][0] == 2
    assert all(a[1] >= b[1] for t in top for a, b in zip(t, t[1:], strict=False))
    barred = mirror.best_rows(queries, 3, min_similarity=0.95)
    assert [[r for r, _ in t] for t in barred] == [[5], [2], []]
    assert ScopeMirror(b"e", 0, 8).best_rows(queries, 3) == [[], [], []]


def test_the_set_drops_the_least_recently_searched_beyond_its_budget() -> None:
    mirrors = MirrorSet(max_bytes=3 * MIN_CAPACITY * 4 * 4 + 1000)
    for name in ("a", "b", "c"):
        mirror = ScopeMirror(name.encode(), 0, 4)
        mirror.append(np.ones((1, 4), np.float32), [b"{}"])
        mirrors.put(name, mirror)
    assert mirrors.get("a") is not None  # a is now the most recently used
    extra = ScopeMirror(b"d", 0, 4)
    extra.append(np.ones((1, 4), np.float32), [b"{}"])
    mirrors.put("d", extra)
    assert mirrors.get("b") is None and mirrors.get("a") is not None
    assert mirrors.get("c") is not None and mirrors.get("d") is not None
    with pytest.raises(ValueError, match="max_bytes"):
        MirrorSet(0)
