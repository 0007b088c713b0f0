"""How one scheduler pass shares the batch fan-out's window between batches.

The window (`batch_max_queued_lines`) bounds the batch jobs queued at once per (model,
priority): the lines of every batch of the pair share one topic order, and a worker can
only reorder what it has fetched. Per pair and pass, the room (the window less the pair's
queued batch jobs) is filled once:

1. while several tenants have batches of the pair (lines to enqueue or queued), each gets
   its weighted share of the window (`tenant_limits.weight`, 1 unless set), less what it
   has queued, from its own batches, earliest deadline first; when the shares add up to
   more than the room (a tenant over its share still has lines queued), each is scaled
   down in proportion;
2. the room left (all of it for a lone tenant) goes to the batches in deadline order:
   earliest `expires_at`, then the first created.

So a batch submitted later with a nearer deadline has its lines enqueued, and reach the
workers, before an earlier batch with a far-off one; that one still gets whatever room the
nearer ones do not need. The pass enqueues the batches in the returned order, so within a
pass too the nearer deadline goes into the topic first.

Pure: the scheduler reads the batches and counts (storage.batch_room) and applies the plan
(scheduler.batches).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class Waiting(Protocol):
    """A batch with lines to enqueue (storage.batch_room.WaitingBatch)."""

    @property
    def batch_id(self) -> str: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def num_left(self) -> int: ...


def plan_room(window: int, waiting: Sequence[Waiting], queued: Mapping[str, int],
              weights: Mapping[str, float]) -> dict[str, int]:
    """Lines each batch of one (model, priority) may enqueue this pass: batch id -> lines,
    in the order to enqueue them (deadline order), batches with none left out.

    `waiting` is in deadline order; `queued` holds each tenant's queued batch jobs of the
    pair; `weights` the tenants' weights (1 when missing). A `window` of 0 means no window:
    every batch may enqueue all its lines.
    """
    if window <= 0:
        return {b.batch_id: b.num_left for b in waiting if b.num_left > 0}
    room = window - sum(queued.values())
    if room <= 0:
        return {}
    granted = {b.batch_id: 0 for b in waiting}
    left = {b.batch_id: b.num_left for b in waiting}
    shares = _tenant_shares(window, room, waiting, queued, weights)
    for batch in waiting:  # 1. each tenant's share, its nearest deadlines first
        take = min(left[batch.batch_id], shares.get(batch.tenant_id, 0))
        shares[batch.tenant_id] = shares.get(batch.tenant_id, 0) - take
        granted[batch.batch_id] += take
        left[batch.batch_id] -= take
        room -= take
    for batch in waiting:  # 2. what is left, nearest deadlines first
        if room <= 0:
            break
        take = min(left[batch.batch_id], room)
        granted[batch.batch_id] += take
        room -= take
    return {b.batch_id: granted[b.batch_id] for b in waiting if granted[b.batch_id] > 0}


def _tenant_shares(window: int, room: int, waiting: Sequence[Waiting],
                   queued: Mapping[str, int], weights: Mapping[str, float]) -> dict[str, int]:
    """Tenant id -> lines of its share it may still enqueue (none for a lone tenant)."""
    tenants = {b.tenant_id for b in waiting} | {t for t, n in queued.items() if n > 0}
    if len(tenants) < 2:
        return {}
    lines_left: dict[str, int] = {}
    for batch in waiting:
        lines_left[batch.tenant_id] = lines_left.get(batch.tenant_id, 0) + batch.num_left
    total_weight = sum(weights.get(t, 1.0) for t in tenants)
    wants = {t: min(lines_left.get(t, 0),
                    max(0, int(window * weights.get(t, 1.0) / total_weight) - queued.get(t, 0)))
             for t in tenants}
    total = sum(wants.values())
    if total > room:
        wants = {t: want * room // total for t, want in wants.items()}
    return wants
