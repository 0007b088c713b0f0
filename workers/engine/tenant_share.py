"""Tenants' share of a step within one priority: who is over it, and how long they may add.

The waiting line's virtual clocks (tenant_clock) give a newcomer tenant seats quickly, but
once seated its sequences decode at the pace of the whole step: a tenant's 50 short jobs
beside another tenant's 200-wide batch each took 3-4x their time on an idle engine. So,
within one priority level, when two or more tenants have running sequences there:

- a tenant's share is the level's running count x its weight / the sum of the weights of
  the tenants present at the level (running or waiting);
- the running sequences of tenants at or under their share are scheduled first, as today;
- the sequences of tenants over their share then join only while the cost model predicts
  the step stays within the tenant step target (`tenant_step_target`); the rest sit the
  step out keeping their KV blocks, as less urgent classes do under a latency class.

Starvation: an over-share tenant is never shut out. Its most urgent sequence always runs
(a floor of one), and the cap is never below the under-share part's time plus
`MIN_OVER_SHARE_ROOM` of what that part adds to the step: however many sequences the
under-share tenants run, the over-share ones may add at least half as much work again.
The over-share sequences are taken fewest output tokens first, so the ones that sat a step
out run at the next: each of them keeps moving, not only their tenant. With the tenants'
counts level (or a lone tenant) nobody is over share and the step is
built exactly as without tenants. Admissions of waiting sequences are left to the level's
own rules: their prefill is already bounded by `max_prefill_step_time`.
"""

from __future__ import annotations

from collections.abc import Iterable

from workers.engine.sequence import Sequence

# The least an over-share tenant's part of the step may cost, relative to what the
# under-share tenants' sequences add to it (see the module docstring).
MIN_OVER_SHARE_ROOM = 0.5


def split_by_share(group: list[Sequence], waiting: Iterable[Sequence],
                   level: int) -> tuple[list[Sequence], list[Sequence]]:
    """(sequences of tenants at or under their weighted share in the order given, those of
    tenants over it, fewest output tokens first). The second is empty, and the first is
    `group` itself, while fewer than two tenants run at the level or nobody is over share."""
    counts: dict[str | None, int] = {}
    weights: dict[str | None, float] = {}
    for seq in group:
        counts[seq.tenant] = counts.get(seq.tenant, 0) + 1
        weights.setdefault(seq.tenant, seq.weight)
    if len(counts) < 2:
        return group, []
    for seq in waiting:
        if seq.priority == level:
            weights.setdefault(seq.tenant, seq.weight)
    total_weight = sum(weights.values())
    over = {tenant for tenant, count in counts.items()
            if count > len(group) * weights[tenant] / total_weight}
    if not over or len(over) == len(counts):
        return group, []
    # Least served first: the sequences that sat the last step out run at the next.
    over_seqs = sorted((s for s in group if s.tenant in over), key=lambda s: s.num_output_tokens)
    return [s for s in group if s.tenant not in over], over_seqs


def over_share_cap(target: float, level_cap: float | None, before: float,
                   after_under: float) -> float:
    """Seconds the step may reach while over-share sequences join it: the tenant target,
    raised to leave them at least MIN_OVER_SHARE_ROOM of the under-share part's cost
    (`after_under - before`, predicted), and never above the cap of a more urgent class."""
    cap = max(target, after_under + MIN_OVER_SHARE_ROOM * max(0.0, after_under - before))
    return cap if level_cap is None else min(cap, level_cap)
