"""How many jobs of each priority a worker may start now: the in-flight bound by urgency.

The bound (`worker_max_inflight`) keeps a worker from hoarding work that other workers
could run. Counted over all jobs alike, a worker holding its bound in `low` jobs would
leave a `high` record waiting in its prefetch buffer (and the broker) until a low job
finished, which behind a batch of long jobs is seconds. So a record's room counts only
the in-flight jobs at least as urgent as it is: a worker full of `low` jobs still starts
a `high` one at once, and the engine displaces or holds back low work for it (latency
classes). Each priority is bounded in turn, so a worker holds at most `limit` jobs per
priority level, never an unbounded number.

Example, limit 8, in flight 8 low and 2 normal: room for high 8 - 0 = 8, for normal
8 - 2 = 6, for low 8 - 10 = -2 (none).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


def count_by_rank(ranks: Iterable[int]) -> Counter[int]:
    """Priority rank -> in-flight jobs of that rank."""
    return Counter(ranks)


def room_for_rank(counts: Counter[int], rank: int, limit: int) -> int:
    """Jobs of priority `rank` that may still start (<= 0: none)."""
    return limit - sum(n for r, n in counts.items() if r <= rank)


def can_take_any(counts: Counter[int], limit: int) -> bool:
    """Whether a record of some priority could still start (the most urgent one always can
    unless the worker's bound is taken by jobs of that very priority)."""
    return room_for_rank(counts, 0, limit) > 0
