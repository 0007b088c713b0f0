"""Inputs waiting for an embedding batch: kept sorted by length, served oldest first.

Responsible for: choosing each next batch so that it pads little and no input waits
forever. A batch starts from the oldest input of the most urgent priority waiting (its
anchor: first come, first served) and takes the inputs nearest to it in length while
rows x width stays within the token budget. Every waiting input is a candidate, whenever
it arrived: a worker hands jobs over a few at a time as others finish, and sorting only
what arrived together (a step's or a round's worth) packed batches at 47-86% real tokens
where one sort of the whole set packs 99%.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass
from typing import Any

from workers.engine.embedding_runner import EncodedInput


@dataclass(slots=True)
class WaitingInput:
    """One input in the pool, and whatever its caller needs to route its vector back."""

    seq: int
    priority: int
    encoded: EncodedInput
    owner: Any


class WaitingInputs:
    """The pool (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[int, WaitingInput] = {}
        self._by_length: list[tuple[int, int]] = []  # (tokens, seq), sorted
        self._by_age: list[tuple[int, int]] = []  # heap of (priority, seq); stale ones skipped
        self._seqs = itertools.count()
        self.num_tokens = 0  # of every input waiting

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, priority: int, encoded: EncodedInput, owner: Any) -> int:
        """Put an input in the pool; its sequence number, for `discard`."""
        seq = next(self._seqs)
        self._entries[seq] = WaitingInput(seq, priority, encoded, owner)
        self.num_tokens += len(encoded.token_ids)
        bisect.insort(self._by_length, (len(encoded.token_ids), seq))
        heapq.heappush(self._by_age, (priority, seq))
        return seq

    def discard(self, seq: int) -> None:
        """Take an input out of the pool (its request was aborted); nothing if not there."""
        entry = self._entries.pop(seq, None)
        if entry is not None:
            self.num_tokens -= len(entry.encoded.token_ids)
            key = (len(entry.encoded.token_ids), seq)
            del self._by_length[bisect.bisect_left(self._by_length, key)]

    def take_batch(self, max_tokens: int, max_rows: int) -> list[WaitingInput]:
        """The next batch, taken out of the pool (empty when the pool is)."""
        while self._by_age and self._by_age[0][1] not in self._entries:
            heapq.heappop(self._by_age)
        if not self._by_age:
            return []
        anchor = self._entries[self._by_age[0][1]]
        width = len(anchor.encoded.token_ids)
        position = bisect.bisect_left(self._by_length, (width, anchor.seq))
        # The batch is a run of the length order around the anchor, [low, high), grown one
        # input at a time on the side that adds less padding: a shorter input pads itself
        # up to the width, a longer one widens every row. An input whose padding would
        # exceed its own tokens is left for a batch nearer its length.
        low, high = position, position + 1
        while high - low < max_rows:
            rows = high - low
            below = (width - self._by_length[low - 1][0]) if low > 0 else None
            above_width = self._by_length[high][0] if high < len(self._by_length) else None
            above = None if above_width is None else (above_width - width) * rows
            if below is not None and (
                    below > width - below or (rows + 1) * width > max_tokens):
                below = None
            if above is not None and above_width is not None and (
                    above > above_width or (rows + 1) * above_width > max_tokens):
                above = None
            if below is None and above is None:
                break
            if above is None or (below is not None and below <= above):
                low -= 1
            else:
                high += 1
                width = above_width or width
        chosen = [self._entries.pop(seq) for _, seq in self._by_length[low:high]]
        self.num_tokens -= sum(length for length, _ in self._by_length[low:high])
        del self._by_length[low:high]
        return chosen
