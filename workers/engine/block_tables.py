"""Block tables kept as rows of one host tensor from step to step, for the paged kernels.

Responsible for one thing: handing the model runner a step's (S, W) int32 block tables
without rebuilding them from Python lists. Each sequence keeps a row while it runs; a step
writes only what changed since the sequence's last step (usually nothing: a decode takes
a new block once every block_size tokens), then gathers its rows in one indexing op.

A row is current while the sequence's `block_table` is the same list object, no shorter
than what was written: the block manager appends to that list as a sequence grows and
replaces it when it frees or admits the sequence (preemption, readmission), so a new
object means "rewrite the row". When rows run out, those of sequences not running (finished,
preempted, or driven outside the scheduler) and not in the step are reclaimed.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from workers.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class _Row:
    """A sequence's row, and the block_table list it was written from (how many entries)."""

    row: int
    source: list[int] | None = None
    num_written: int = 0


class BlockTableRows:
    """Per-sequence rows of padded block tables, updated incrementally (see module doc)."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int) -> None:
        self.table = torch.zeros(num_rows, max_blocks_per_seq, dtype=torch.int32)
        self._rows = self.table.numpy()  # the same memory: cheap writes of a few entries
        self._row_of: dict[Sequence, _Row] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def gather(self, seqs: list[Sequence]) -> torch.Tensor:
        """(len(seqs), W) int32: each sequence's table, W its longest; entries past a
        table's end are never read by the kernels."""
        rows: list[int] = []
        width = 0
        row_of, table_rows = self._row_of, self._rows
        for seq in seqs:
            entry = row_of.get(seq)
            if entry is None:
                entry = self._assign(seq, seqs)
            table = seq.block_table
            n = len(table)
            if entry.source is not table or entry.num_written > n:
                table_rows[entry.row, :n] = table
                entry.source, entry.num_written = table, n
            elif entry.num_written < n:
                table_rows[entry.row, entry.num_written:n] = table[entry.num_written:]
                entry.num_written = n
            rows.append(entry.row)
            if n > width:
                width = n
        # From an array: torch.tensor() of a list of ints costs ~10x more.
        index = torch.frombuffer(array("q", rows), dtype=torch.int64)
        return self.table[:, :width].index_select(0, index)

    def _assign(self, seq: Sequence, keep: list[Sequence]) -> _Row:
        if not self._free_rows:
            self._reclaim(keep)
        if not self._free_rows:
            raise RuntimeError("more sequences in one step than block table rows")
        entry = _Row(self._free_rows.pop())
        self._row_of[seq] = entry
        return entry

    def _reclaim(self, keep: list[Sequence]) -> None:
        """Free the rows of sequences that are not running, except the step's own."""
        in_step = set(keep)
        for seq, entry in list(self._row_of.items()):
            if seq.status is not SequenceStatus.RUNNING and seq not in in_step:
                del self._row_of[seq]
                self._free_rows.append(entry.row)
