"""A batch's state as routes need it: read it now, or wait for it to end.

A wait subscribes to the batch's terminal-status event (`storage.events.wait_batch_done`),
which the batch loop publishes after its commit, and re-reads the batch once it is heard
or the wait is over: a client following a batch learns that it ended within moments,
instead of up to one polling interval later, and asks far less often while it runs.
Each read uses a session of its own on the thread pool, so a long wait never holds a
database transaction open.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.resources import Resources
from storage.batch_room import unqueued_lines_ahead
from storage.batches import Batch, BatchStatus, batch_object, get_batch
from storage.estimates import BatchLeft, read_batch_left
from storage.events import wait_batch_done
from storage.models import utcnow
from storage.tenant_limits import budgets_of, limits_of_tenant


def load_batch(resources: Resources, *, batch_id: str, tenant_id: str) -> dict[str, Any] | None:
    """The tenant's batch object as the database has it now; None if missing or not theirs."""
    with resources.sessions() as session:
        batch = get_batch(session, batch_id=batch_id, tenant_id=tenant_id)
        if batch is None:
            return None
        return batch_view(resources, session, batch)


def batch_view(resources: Resources, session: Session, batch: Batch) -> dict[str, Any]:
    """The batch object, with `estimated_completion_at` while it is in progress."""
    view = batch_object(batch)
    if batch.status == BatchStatus.IN_PROGRESS and batch.model:
        is_fanning_out = batch.num_enqueued < batch.num_requests
        # The fan-out gives room to nearer deadlines first: their lines still in files go
        # before this batch's (scheduler.fanout_plan).
        num_ahead = unqueued_lines_ahead(session, batch, now=utcnow()) if is_fanning_out else 0
        at = resources.estimates.batch_completion(
            model=batch.model, priority=batch.priority, batch_id=batch.id,
            deadline=batch.expires_at, read_left=lambda: _read_left(resources, batch.id),
            num_unqueued_ahead=num_ahead,
            budget_tokens_per_s=_budget_pace(session, batch.tenant_id, batch.model)
            if is_fanning_out else None)
        view["estimated_completion_at"] = None if at is None else round(at)
    return view


def _read_left(resources: Resources, batch_id: str) -> BatchLeft:
    """What the batch has left, in a transaction begun now (see batch_completion)."""
    with resources.sessions() as session:
        return read_batch_left(session.connection(), batch_id=batch_id)


def _budget_pace(session: Session, tenant_id: str, model: str) -> float | None:
    """The tightest of the tenant's token budgets for the model, in tokens per second."""
    budgets = budgets_of(limits_of_tenant(session, tenant_id=tenant_id), model=model)
    return min((b.limit / b.window_s for b in budgets), default=None)


async def wait_for_batch(
    resources: Resources, *, batch_id: str, tenant_id: str, timeout: float
) -> dict[str, Any] | None:
    """The batch object once the batch ends, or as it is when `timeout` seconds have passed."""
    async def read() -> dict[str, Any] | None:
        return await run_in_threadpool(load_batch, resources, batch_id=batch_id,
                                       tenant_id=tenant_id)

    if timeout <= 0:
        return await read()
    # The check after subscribing is the first read: an ended (or unknown) batch is
    # answered with it, one that runs on is read again when the wait is over.
    checked: list[dict[str, Any] | None] = []

    async def has_ended() -> bool:
        checked.append(await read())
        return checked[-1] is None or _has_ended(checked[-1])

    await wait_batch_done(resources.aredis, prefix=resources.settings.topic_prefix,
                          batch_id=batch_id, timeout=timeout, is_done=has_ended)
    if checked and (checked[-1] is None or _has_ended(checked[-1])):
        return checked[-1]
    return await read()


def _has_ended(batch: dict[str, Any]) -> bool:
    return BatchStatus(batch["status"]).is_terminal
