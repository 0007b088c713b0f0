"""A process's copy of semantic-cache scopes: their vectors as one float32 matrix.

Responsible for: holding, per scope, the rows Redis holds (vectors and their raw meta
JSON, parsed only for the few rows a search picks) and, where the process scans in
float16 (`storage.semantic_scan`), a float16 copy of the vectors beside them; growing by
appends without copying the whole matrix each time (capacity doubles), dropping rows
trimmed from the scope's head, finding each query's best rows (`semantic_scan.best_rows`:
an approximate pass over every row, the few that may win rescored exactly from the
float32 rows), and keeping all mirrors of the process within a byte budget (the least
recently searched scope goes first; it is simply read again from Redis when next
searched).

Memory per entry of 384 dimensions: 1,536 bytes of float32, plus 768 of float16 where
the process scans in float16 (the float32 rows stay: the exact rescoring reads them),
plus its meta JSON; the budget counts all of it.

Rows are addressed by their absolute index in the scope (entries ever added, counting
the trimmed ones): the mirror of a scope whose head was trimmed to absolute index 40
holds rows 40, 41, ... at buffer rows first, first + 1, ...
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from storage import semantic_scan
from storage.semantic_scan import RowScorer

# Rows a new buffer has room for before its first doubling.
MIN_CAPACITY = 1024
# What CPython spends on a bytes object besides its contents.
BYTES_OBJECT_OVERHEAD = 33


@dataclass(slots=True)
class ScopeMirror:
    """One scope's rows in this process, in the order Redis holds them."""

    epoch: bytes  # the scope's incarnation: a scope that expired and began again differs
    start: int  # absolute index of the oldest row held
    dims: int
    half: bool = False  # keep a float16 copy of the rows for the scan
    _buffer: np.ndarray = field(init=False)  # (capacity, dims) float32; rows first..
    _half_buffer: np.ndarray | None = field(init=False)  # its float16 copy, row for row
    _first: int = 0
    _metas: list[bytes] = field(default_factory=list)
    _num_meta_bytes: int = 0

    def __post_init__(self) -> None:
        self._buffer = np.empty((0, self.dims), dtype=np.float32)
        self._half_buffer = np.empty((0, self.dims), dtype=np.float16) if self.half else None

    def __len__(self) -> int:
        return len(self._metas)

    @property
    def end(self) -> int:
        """Absolute index of the next row to come."""
        return self.start + len(self._metas)

    @property
    def vectors(self) -> np.ndarray:
        """(rows, dims) view of the held unit vectors."""
        return self._buffer[self._first : self._first + len(self._metas)]

    @property
    def half_vectors(self) -> np.ndarray | None:
        """(rows, dims) float16 view of the same rows, if this mirror keeps one."""
        if self._half_buffer is None:
            return None
        return self._half_buffer[self._first : self._first + len(self._metas)]

    @property
    def capacity(self) -> int:
        """Rows the buffer holds before it must grow (trimmed head rows included)."""
        return len(self._buffer)

    @property
    def num_bytes(self) -> int:
        """Bytes this mirror takes (its buffer and raw metas), roughly."""
        half_bytes = 0 if self._half_buffer is None else self._half_buffer.nbytes
        return (self._buffer.nbytes + half_bytes + self._num_meta_bytes
                + BYTES_OBJECT_OVERHEAD * len(self))

    def reserve(self, num_rows: int) -> None:
        """Make room for `num_rows` rows in all, so a known number of appends copies none."""
        if self._first + num_rows > len(self._buffer):
            self._resize(max(num_rows, len(self)))

    def append(self, vectors: np.ndarray, metas: list[bytes]) -> None:
        """Add rows at the end; `vectors` is (len(metas), dims)."""
        if vectors.shape != (len(metas), self.dims):
            raise ValueError(f"vectors must be ({len(metas)}, {self.dims}), got {vectors.shape}")
        self.append_chunks([vectors.astype(np.float32).tobytes()], [b"\n".join(metas)])

    def append_chunks(self, vector_chunks: list[bytes], meta_chunks: list[bytes], *,
                      skip: int = 0) -> None:
        """Add the entries of chunks as Redis keeps them (vectors back to back; metas joined
        by newlines), less the first `skip` entries of the first chunk."""
        metas = [m for chunk in meta_chunks for m in chunk.split(b"\n")][skip:]
        row_bytes = 4 * self.dims
        if sum(len(c) for c in vector_chunks) != (skip + len(metas)) * row_bytes:
            raise ValueError(f"chunks hold {sum(len(c) for c in vector_chunks)} vector bytes "
                             f"for {skip + len(metas)} metas of {self.dims} floats")
        num_rows, num_new = len(self._metas), len(metas)
        if self._first + num_rows + num_new > len(self._buffer):
            # Full: move the rows to the front of a buffer twice their size (or of the same
            # size when trimmed head rows left room), so n appends copy O(n) rows in all.
            self._resize(max(MIN_CAPACITY, 2 * (num_rows + num_new), len(self._buffer)))
        at, offset = self._first + num_rows, skip * row_bytes
        for chunk in vector_chunks:  # straight into the buffer: no joined copy
            rows = np.frombuffer(chunk, dtype=np.float32, offset=min(offset, len(chunk)))
            end = at + len(rows) // self.dims
            self._buffer[at:end] = rows.reshape(-1, self.dims)
            if self._half_buffer is not None:
                _round_to_half(self._half_buffer[at:end], self._buffer[at:end])
            at = end
            offset = max(0, offset - len(chunk))
        self._metas.extend(metas)
        self._num_meta_bytes += sum(len(m) for m in metas)

    def _resize(self, capacity: int) -> None:
        """Move the held rows to the front of a new buffer of `capacity` rows."""
        grown = np.empty((capacity, self.dims), dtype=np.float32)
        grown[: len(self)] = self.vectors
        if self._half_buffer is not None:
            half_grown = np.empty((capacity, self.dims), dtype=np.float16)
            half_grown[: len(self)] = self.half_vectors
            self._half_buffer = half_grown
        self._buffer, self._first = grown, 0

    def drop_head(self, num_rows: int) -> None:
        """Forget the oldest `num_rows` rows (Redis trimmed them)."""
        num_rows = min(num_rows, len(self._metas))
        self._first += num_rows
        self.start += num_rows
        self._num_meta_bytes -= sum(len(m) for m in self._metas[:num_rows])
        del self._metas[:num_rows]

    def best_rows(self, queries: np.ndarray, k: int, min_similarity: float = -1.0,
                  scorer: RowScorer | None = None) -> list[list[tuple[int, float]]]:
        """Per query (a row of `queries`, unit vectors): its at most `k` most similar rows
        at least `min_similarity` alike, best first, as (row position, exact similarity);
        `scorer` makes the approximate pass (default: float32, no float16 copy read)."""
        return semantic_scan.best_rows(queries, self.vectors, self.half_vectors,
                                       scorer or RowScorer(half=False), k, min_similarity)

    def meta(self, row: int) -> dict[str, Any]:
        """The parsed meta JSON of a held row."""
        value: dict[str, Any] = json.loads(self._metas[row])
        return value


class MirrorSet:
    """Every scope mirror of a process, within `max_bytes` (least recently used go)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._mirrors: OrderedDict[str, ScopeMirror] = OrderedDict()

    def get(self, scope: str) -> ScopeMirror | None:
        """The scope's mirror (now the most recently used), or None."""
        mirror = self._mirrors.get(scope)
        if mirror is not None:
            self._mirrors.move_to_end(scope)
        return mirror

    def put(self, scope: str, mirror: ScopeMirror) -> None:
        """Keep a mirror, dropping the least recently used others beyond the budget."""
        self._mirrors[scope] = mirror
        self._mirrors.move_to_end(scope)
        total = sum(m.num_bytes for m in self._mirrors.values())
        while total > self.max_bytes and len(self._mirrors) > 1:
            _, dropped = self._mirrors.popitem(last=False)
            total -= dropped.num_bytes

    def discard(self, scope: str) -> None:
        """Forget a scope's mirror."""
        self._mirrors.pop(scope, None)


# Elements below which torch runs an element-wise op on the calling thread alone
# (at::internal::GRAIN_SIZE).
TORCH_GRAIN_ELEMENTS = 32768


def _round_to_half(out: np.ndarray, rows: np.ndarray) -> None:
    """Write float32 `rows` into float16 `out`, rounded to nearest as the scan's error
    bound assumes. Through torch where it is loaded (a float16 copy is kept only there):
    its vectorised conversion took 0.16 s per 100,000 rows of 384 here, numpy's 0.62 s,
    most of a worker's first lookup of a large scope."""
    torch = sys.modules.get("torch")
    if torch is None:
        out[...] = rows
        return
    # In slices under torch's parallel grain, so each copy stays on this thread: spread
    # over the OpenMP threads beside a busy engine, 100,000 rows took 0.7-1.0 s, not 0.07.
    step = max(1, TORCH_GRAIN_ELEMENTS // max(1, rows.shape[1]))
    for at in range(0, len(rows), step):
        torch.from_numpy(out[at : at + step]).copy_(torch.from_numpy(rows[at : at + step]))
