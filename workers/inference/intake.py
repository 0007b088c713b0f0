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

Tenants within a priority (`InFlightCounts.room_for_tenant`): while another tenant has
records of that priority waiting in the prefetch buffer, a tenant may hold at most its
weighted share of the bound there (`limit x weight / the weights of the tenants waiting or
in flight at that priority`, rounded up), and what other tenants hold beyond their own
shares does not count against it. So a tenant that filled the worker alone stops taking
more the moment another tenant's record is here, and that tenant's records start at once
instead of one per job the first tenant finishes: its share was free. Alone, a tenant
has the whole bound as before (no loss for a lone tenant). Like urgency, this may take the
worker past `limit` for a while, by at most what the over-share tenants held (so below
twice the bound); finishing jobs bring it back, as over-share tenants start nothing.

Example, limit 8, tenant A holds 8 low, B's 3 low records arrive (weights 1): shares 4
and 4; room for B = min(8 - 0 - min(8, 4), 4 - 0) = 4, so B's 3 start (11 in flight);
room for A = min(8 - 8 - 0, 4 - 8) < 0 until B has nothing waiting, then 8 - 11 as before.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable

from core.messages import JobMessage
from core.topics import Priority
from workers.inference.prefetch import MIN_WEIGHT
from workers.inference.tenant_share import message_tenant


def count_key(message: JobMessage) -> tuple[int, str]:
    """What a job counts under in `InFlightCounts`: its priority rank and tenant."""
    return Priority(message.priority).rank, message_tenant(message.tenant_id)


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


def can_overtake(counts: Counter[int], prefetched_rank: int | None, limit: int) -> bool:
    """Whether a record more urgent than every job held (in flight by rank, and the most
    urgent prefetched rank) would start at once; False while nothing is held."""
    held = [rank for rank in (min(counts, default=None), prefetched_rank) if rank is not None]
    return bool(held) and min(held) > 0 and can_take_any(counts, limit)


class InFlightCounts:
    """In-flight jobs (and those being started) by priority rank and by rank and tenant."""

    def __init__(self, jobs: Iterable[tuple[int, str]] = ()) -> None:
        self.by_rank: Counter[int] = Counter()
        self.by_tenant: Counter[tuple[int, str]] = Counter()
        for rank, tenant in jobs:
            self.add(rank, tenant)

    def add(self, rank: int, tenant: str) -> None:
        """Count one more job of this rank and tenant."""
        self.by_rank[rank] += 1
        self.by_tenant[rank, tenant] += 1

    def remove(self, rank: int, tenant: str) -> None:
        """Count one job of this rank and tenant less (one that was added)."""
        self.by_rank[rank] -= 1
        self.by_tenant[rank, tenant] -= 1
        if not self.by_tenant[rank, tenant]:
            del self.by_tenant[rank, tenant]
        if not self.by_rank[rank]:
            del self.by_rank[rank]

    def copy(self) -> InFlightCounts:
        """Counts that change apart from these."""
        other = InFlightCounts()
        other.by_rank = self.by_rank.copy()
        other.by_tenant = self.by_tenant.copy()
        return other

    def room_for_tenant(self, rank: int, tenant: str, limit: int, *,
                        waiting: Collection[str], weight_of: Callable[[str], float]) -> int:
        """Jobs of `tenant` at `rank` that may still start (<= 0: none), given the tenants
        with records of that rank waiting (see the module docstring)."""
        room = room_for_rank(self.by_rank, rank, limit)
        if all(other == tenant for other in waiting):
            return room  # alone: the whole bound
        sharing = set(waiting) | {t for (r, t), n in self.by_tenant.items() if r == rank and n}
        sharing.add(tenant)
        weights = {t: max(weight_of(t), MIN_WEIGHT) for t in sharing}
        total = sum(weights.values())

        def share(t: str) -> int:
            return math.ceil(limit * weights[t] / total)

        more_urgent = sum(n for r, n in self.by_rank.items() if r < rank)
        own = self.by_tenant[rank, tenant]
        others = sum(min(self.by_tenant[rank, t], share(t)) for t in sharing if t != tenant)
        return min(limit - more_urgent - own - others, share(tenant) - own)

    def may_start(self, rank: int, limit: int, *, waiting: Collection[str],
                  weight_of: Callable[[str], float]) -> Callable[[str], bool]:
        """Whether a tenant's record of `rank` may start now, as these counts stand."""
        return lambda tenant: self.room_for_tenant(
            rank, tenant, limit, waiting=waiting, weight_of=weight_of) > 0
