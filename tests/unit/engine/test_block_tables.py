"""Block table rows kept from step to step equal the tables rebuilt from scratch."""

from __future__ import annotations

import random

import torch

from workers.engine.attention import padded_block_tables
from workers.engine.block_tables import BlockTableRows
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence, SequenceStatus


def running(name: str, table: list[int]) -> Sequence:
    """A running sequence holding `table`."""
    seq = Sequence(name, [1, 2, 3], SamplingParams())
    seq.status = SequenceStatus.RUNNING
    seq.block_table = table
    return seq


def expected(seqs: list[Sequence], width: int) -> torch.Tensor:
    """Each table padded to `width`, as if built anew."""
    return padded_block_tables([s.block_table for s in seqs])[:, :width]


def matches(rows: BlockTableRows, seqs: list[Sequence]) -> bool:
    """The gathered rows agree with the tables on every entry a kernel reads."""
    got = rows.gather(seqs)
    width = max(len(s.block_table) for s in seqs)
    assert got.shape == (len(seqs), width) and got.dtype == torch.int32
    return all(got[i, : len(s.block_table)].tolist() == s.block_table
               for i, s in enumerate(seqs))


def test_rows_follow_appends_replacements_and_reordering() -> None:
    """Appended blocks, a table replaced (preemption, readmission) by one of the same
    length, and any row order: every gather equals the tables themselves."""
    rows = BlockTableRows(num_rows=4, max_blocks_per_seq=8)
    a, b = running("a", [5, 6]), running("b", [7])
    assert matches(rows, [a, b])
    a.block_table.append(9)
    assert matches(rows, [b, a])
    b.block_table = [3]  # a new list object: the row is rewritten, not trusted
    assert matches(rows, [a, b])
    assert rows.gather([a]).tolist() == expected([a], 3).tolist()


def test_rows_of_sequences_that_left_are_reused() -> None:
    """More sequences over time than rows: finished ones give theirs back; the step's own
    and the running ones keep theirs."""
    rng = random.Random(0)
    rows = BlockTableRows(num_rows=4, max_blocks_per_seq=8)
    live: list[Sequence] = []
    for i in range(40):
        seq = running(f"s{i}", [rng.randrange(100) for _ in range(rng.randint(1, 8))])
        live.append(seq)
        if len(live) > 2:
            gone = live.pop(rng.randrange(len(live)))
            gone.status = SequenceStatus.FINISHED_LENGTH
        for s in live:
            if len(s.block_table) < 8 and rng.random() < 0.5:
                s.block_table.append(rng.randrange(100))
        assert matches(rows, live)
