"""Tenants' share of a step within one priority: who is over it, and how far they are held.

The waiting line's virtual clocks (tenant_clock) give a newcomer tenant seats quickly, but
once seated its sequences decode at the pace of the whole step: a tenant's 50 short jobs
beside another tenant's 200-wide batch each took 3-4x their time on an idle engine. So,
within one priority level, when two or more tenants have running sequences there:

- a tenant's share is the level's running count x its weight / the sum of the weights of
  the tenants present at the level (running or waiting);
- the running sequences of tenants at or under their share are scheduled first, as today;
- the sequences of tenants over their share then join only while the cost model predicts
  the step within a cap (`TenantShare.cap`); the rest sit the step out keeping their KV
  blocks, as less urgent classes do under a latency class.

The cap is bounded by what it costs the over-share tenants, not by a fixed step time.
With U the predicted step without them and F with all of them, a step capped at T lets
them compute (T - U) / (F - U) of their work in T seconds instead of all of it in F, so
they keep (T - U) F / ((F - U) T) of their throughput. Two caps follow:

- the loss bound: the T at which they keep 1 - max_loss of it, U F / (max_loss F +
  (1 - max_loss) U) (max_loss 0.1, U = 0.1 F: T = 0.53 F, the small tenant's steps ~1.9x
  faster for 10% of the big one's rate). It always holds;
- their fair share of the step's time: T - U >= T x their weights / the running tenants'
  weights, i.e. T = U / (1 - that fraction) (2 U for two equal tenants). It is deeper and
  costs more, so it applies only while the over-share tenants have loss credit: they earn
  max_loss x each step's predicted time, up to max_loss x LOSS_WINDOW_S, and every step
  spends what it cost them (`lost_seconds`). A short burst of a small tenant's jobs thus
  runs at its fair share of time, paid from the big tenant's uncapped past; a small tenant
  that keeps jobs running all day spends the credit, then meets the loss bound alone, so
  the big tenant loses max_loss of its rate over any long run, not more.

The cost model is the engine's own, fitted from its steps, so U and F hold on any device:
where the step's fixed cost dominates (a GPU decode), U is close to F and little is held.
Starvation: each over-share tenant's least served sequence always runs (a floor of one), and
its sequences are taken fewest output tokens first, so those that sat a step out run at
the next. With the tenants' counts level (or a lone tenant) nobody is over share and the
step is built exactly as without tenants. Admissions of waiting sequences are left to the
level's own rules: their prefill is already bounded by `max_prefill_step_time`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from workers.engine.sequence import Sequence
from workers.engine.step_cost import EMPTY_STEP, StepShape

# Seconds of steps whose loss budget the over-share tenants may hold as credit (see the
# module docstring): at max_loss 0.1, 30 s of lost time, about a minute of a small
# tenant's burst at its fair share of the step before the loss bound alone holds.
LOSS_WINDOW_S = 300.0


@dataclass(frozen=True, slots=True)
class ShareSplit:
    """A level's running sequences split by their tenants' weighted share."""

    under: list[Sequence]  # tenants at or under their share, in the order given
    # Tenants over it: the least served sequence of each (the floor, `num_floor` of them),
    # then the rest, fewest output tokens first.
    over: list[Sequence]
    num_floor: int = 0
    # The over-share tenants' weights over those of every tenant running at the level.
    over_weight_fraction: float = 0.0


def split_by_share(group: list[Sequence], waiting: Iterable[Sequence],
                   level: int) -> ShareSplit:
    """Split `group` (one level's running sequences) by share. `over` is empty, and `under`
    is `group` itself, while fewer than two tenants run at the level or nobody is over."""
    if not group:
        return ShareSplit(group, [])
    # The common case, one tenant (or none named): this runs every step, so no dicts.
    first = group[0].tenant
    if all(s.tenant == first for s in group):
        return ShareSplit(group, [])
    counts: dict[str | None, int] = {}
    weights: dict[str | None, float] = {}
    for seq in group:
        counts[seq.tenant] = counts.get(seq.tenant, 0) + 1
        weights.setdefault(seq.tenant, seq.weight)
    if len(counts) < 2:
        return ShareSplit(group, [])
    running_weight = sum(weights.values())
    for seq in waiting:
        if seq.priority == level:
            weights.setdefault(seq.tenant, seq.weight)
    total_weight = sum(weights.values())
    over = {tenant for tenant, count in counts.items()
            if count > len(group) * weights[tenant] / total_weight}
    if not over or len(over) == len(counts):
        return ShareSplit(group, [])
    # Least served first: the sequences that sat the last step out run at the next.
    over_seqs = sorted((s for s in group if s.tenant in over), key=lambda s: s.num_output_tokens)
    floor: dict[str | None, Sequence] = {}
    for seq in over_seqs:
        floor.setdefault(seq.tenant, seq)
    rest = [s for s in over_seqs if floor[s.tenant] is not s]
    return ShareSplit([s for s in group if s.tenant not in over], [*floor.values(), *rest],
                      len(floor), sum(weights[t] for t in over) / running_weight)


def running_shape(seqs: Iterable[Sequence], budget: int) -> StepShape:
    """What these running sequences would add to a step if all of them ran within
    `budget` tokens (a decode's one token, a prefill's chunk up to the budget left)."""
    shape = EMPTY_STEP
    for seq in seqs:
        num_new = min(seq.num_uncomputed_tokens, budget - shape.num_tokens)
        if num_new <= 0:
            break
        shape = shape.plus(num_new, seq.num_computed_tokens + num_new)
    return shape


def loss_bound_cap(under_s: float, full_s: float, max_loss: float) -> float:
    """Step seconds at which the over-share part keeps 1 - max_loss of its throughput:
    under_s without it, full_s with all of it (the module docstring derives it)."""
    if full_s <= under_s:
        return full_s
    return under_s * full_s / (max_loss * full_s + (1 - max_loss) * under_s)


def fair_time_cap(under_s: float, over_weight_fraction: float) -> float:
    """Step seconds at which the over-share part has its weighted share of the step's
    time: T - under_s = T x over_weight_fraction."""
    return under_s / (1 - over_weight_fraction)


def lost_seconds(under_s: float, full_s: float, step_s: float) -> float:
    """Seconds of the over-share part's uncapped throughput a step of step_s gave up:
    step_s less the time it takes them, at their uncapped rate, to do what they did."""
    if full_s <= under_s or step_s >= full_s:
        return 0.0
    return max(0.0, step_s - (step_s - under_s) * full_s / (full_s - under_s))


class TenantShare:
    """The over-share tenants' cap, bounded by what it costs them (module docstring)."""

    def __init__(self, max_loss: float) -> None:
        if not 0 < max_loss < 1:
            raise ValueError(f"tenant max_loss must be in (0, 1), got {max_loss}")
        self.max_loss = max_loss
        self.max_credit_s = max_loss * LOSS_WINDOW_S
        # Starts full: the first burst borrows from the run ahead, as a later one would
        # from the run behind it.
        self.credit_s = self.max_credit_s

    def cap(self, under_s: float, full_s: float, over_weight_fraction: float) -> float:
        """Seconds the step may reach with the over-share part (beyond its floor) in it."""
        cap = loss_bound_cap(under_s, full_s, self.max_loss)
        if self.credit_s > 0:
            cap = min(cap, fair_time_cap(under_s, over_weight_fraction))
        return cap

    def settle(self, step_s: float, lost_s: float) -> None:
        """Credit the step's loss budget (max_loss x its predicted seconds) and charge what
        the cap cost the over-share tenants in it."""
        self.credit_s = min(self.max_credit_s,
                            self.credit_s + self.max_loss * step_s - lost_s)
