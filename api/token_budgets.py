"""Admitting a submission against its tenant's token budgets (`storage.token_budget`).

Responsible for: knowing each tenant's budgets without a database read per submission
(rows re-read at most every `tenant_limits_refresh_s` per tenant, in the thread pool),
reserving the job's estimated tokens in Redis before it is stored, and refusing it with a
429 that names the budget and says when it refills. A tenant without budgets costs a
dictionary look-up. Redis unreachable: the job is admitted (logged), as the request-rate
limiter does; the workers' settling then finds no reservation and changes nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.errors import RateLimited
from core.settings import Settings
from storage.models import Job, TenantLimit
from storage.tenant_limits import Budget, budgets_of, limits_of_tenant
from storage.token_budget import TokenBudgets, estimate_tokens

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Known:
    rows: list[TenantLimit]
    read_at: float


class BudgetGate:
    """Reserves a job's tokens against its tenant's budgets, or raises RateLimited."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session],
                 aredis: aioredis.Redis, redis_client: redis.Redis) -> None:
        self._settings = settings
        self._sessions = sessions
        self._budgets = TokenBudgets(aredis, prefix=settings.topic_prefix)
        self._sync_budgets = TokenBudgets(redis_client, prefix=settings.topic_prefix)
        self._known: dict[str, _Known] = {}

    async def budgets_for(self, tenant_id: str, model: str) -> list[Budget]:
        """The budgets a job of this tenant and model counts against (cached rows)."""
        known = self._known.get(tenant_id)
        if known is None or time.monotonic() - known.read_at >= \
                self._settings.tenant_limits_refresh_s:
            rows = await run_in_threadpool(self._read, tenant_id)
            known = self._known[tenant_id] = _Known(rows, time.monotonic())
        return budgets_of(known.rows, model=model)

    def _read(self, tenant_id: str) -> list[TenantLimit]:
        with self._sessions() as session:
            rows = limits_of_tenant(session, tenant_id=tenant_id)
            session.expunge_all()
            return rows

    async def reserve(self, job: Job) -> None:
        """Reserve the job's estimated tokens; RateLimited (429) when a budget is spent."""
        budgets = await self.budgets_for(job.tenant_id, job.model)
        if not budgets:
            return
        estimate = estimate_tokens(
            job.request, default_completion_tokens=self._settings.budget_default_completion_tokens)
        try:
            verdict = await self._budgets.reserve_async(
                tenant_id=job.tenant_id, budgets=budgets, jobs=[(job.id, estimate)])
        except redis.RedisError as e:
            logger.warning("token budgets unavailable (%s); admitting job %s", e, job.id)
            return
        if verdict.num_granted:
            return
        blocking = verdict.blocking
        assert blocking is not None, "a refusal names the budget that refused"
        raise RateLimited(
            f"Token budget reached: {blocking.name} is {blocking.limit:,} tokens and this "
            f"job needs about {estimate:,} more than are left; it refills in "
            f"{verdict.retry_after_s:.0f} s.",
            retry_after_s=verdict.retry_after_s, code="token_budget_exceeded",
            param=blocking.name.split(" ")[0])

    async def release(self, job: Job) -> None:
        """Give back a reservation of a job that was not stored after all."""
        await run_in_threadpool(self._sync_budgets.settle, [(job.id, 0)])
