"""Tenants' token budgets and fair-share weights (`tenant_limits` rows).

Responsible for: writing a tenant's limits (`batchinfer tenants set-limits`), reading the
limits that apply to one tenant and model (its "*" row and its row for that model), and
the weights of every tenant for the workers' fair share. Functions flush but never commit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import Tenant, TenantLimit, utcnow

# `tenant_limits.model` of the row that applies to every model of the tenant.
ALL_MODELS = "*"
# A budget field set to this (or below) clears it: no limit of that kind.
UNLIMITED = 0


@dataclass(frozen=True, slots=True)
class Budget:
    """One token budget: at most `limit` tokens per `window_s` seconds, for `model`
    ("*": all the tenant's models together)."""

    model: str
    window_s: int
    limit: int

    @property
    def is_rate(self) -> bool:
        """A per-minute budget: a rate, kept as a continuously refilled bucket."""
        return self.window_s == 60

    @property
    def name(self) -> str:
        """How errors and `tenants show` name it: `tokens_per_minute` (model ...)."""
        kind = "tokens_per_minute" if self.window_s == 60 else "tokens_per_day"
        return kind if self.model == ALL_MODELS else f"{kind} for model {self.model}"


# The largest budget a limits row holds (its columns are 32-bit integers on PostgreSQL).
MAX_TOKEN_BUDGET = 2**31 - 1


def set_limits(
    session: Session, *, tenant_id: str, model: str = ALL_MODELS,
    tokens_per_minute: int | None = None, tokens_per_day: int | None = None,
    weight: float | None = None,
) -> TenantLimit:
    """Create or update the tenant's row for `model`; a field left None keeps its value,
    a budget of 0 removes that budget. ValueError for values out of range or an unknown
    tenant."""
    if session.get(Tenant, tenant_id) is None:
        raise ValueError(f"unknown tenant {tenant_id!r}; create it with `batchinfer keys create`")
    for name, value in (("tokens_per_minute", tokens_per_minute),
                        ("tokens_per_day", tokens_per_day)):
        if value is not None and not 0 <= value <= MAX_TOKEN_BUDGET:
            raise ValueError(f"{name} must be 0 (no limit) to {MAX_TOKEN_BUDGET}, not {value}")
    if weight is not None and not 0 < weight < math.inf:
        # inf (or nan) would pass to the engine, which refuses it for every job.
        raise ValueError(f"weight must be a finite number above 0, not {weight}")
    if weight is not None and model != ALL_MODELS:
        raise ValueError("a weight applies to the tenant as a whole: set it without --model")
    row = session.get(TenantLimit, (tenant_id, model))
    if row is None:
        row = TenantLimit(tenant_id=tenant_id, model=model, weight=1.0)
        session.add(row)
    if tokens_per_minute is not None:
        row.tokens_per_minute = tokens_per_minute or None
    if tokens_per_day is not None:
        row.tokens_per_day = tokens_per_day or None
    if weight is not None:
        row.weight = weight
    row.updated_at = utcnow()
    session.flush()
    return row


def limits_of_tenant(session: Session, *, tenant_id: str) -> list[TenantLimit]:
    """The tenant's rows, "*" first, then by model."""
    rows = session.scalars(select(TenantLimit).where(TenantLimit.tenant_id == tenant_id))
    return sorted(rows, key=lambda r: (r.model != ALL_MODELS, r.model))


def budgets_of(rows: list[TenantLimit], *, model: str) -> list[Budget]:
    """The budgets a job of `model` counts against: the tenant's "*" ones and its
    model's, per minute and per day."""
    budgets = []
    for row in rows:
        if row.model not in (ALL_MODELS, model):
            continue
        if row.tokens_per_minute:
            budgets.append(Budget(row.model, 60, row.tokens_per_minute))
        if row.tokens_per_day:
            budgets.append(Budget(row.model, 86_400, row.tokens_per_day))
    return budgets


def tenant_weights(session: Session) -> dict[str, float]:
    """Tenant id -> fair-share weight, for tenants that set one (others weigh 1)."""
    query = select(TenantLimit.tenant_id, TenantLimit.weight).where(
        TenantLimit.model == ALL_MODELS)
    return {tenant_id: float(weight) for tenant_id, weight in session.execute(query)}
