"""What the estimates read from the jobs table: the work a finished job turned out to be."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session

from storage.estimates import read_loads
from storage.jobs import create_job
from storage.models import JobStatus, Tenant, utcnow


def finished(session: Session, tenant: Tenant, *, max_tokens: int | None, completion: int,
             attempts: int = 1) -> None:
    job = create_job(session, tenant_id=tenant.id, priority="normal", model="m",
                     kind="chat.completion",
                     request={"model": "m", "messages": [], "max_tokens": max_tokens})
    job.status, job.finished_at, job.attempts = JobStatus.SUCCEEDED, utcnow(), attempts
    job.prompt_tokens, job.completion_tokens = 10, completion


def test_the_share_of_max_tokens_used_is_learned_from_jobs_that_ran(
        session: Session, tenant: Tenant) -> None:
    finished(session, tenant, max_tokens=100, completion=50)
    finished(session, tenant, max_tokens=40, completion=40)
    finished(session, tenant, max_tokens=None, completion=30)  # no limit: not in the share
    finished(session, tenant, max_tokens=1000, completion=1, attempts=0)  # a cache answer
    # A model is read while it has work (or live workers).
    create_job(session, tenant_id=tenant.id, priority="normal", model="m",
               kind="chat.completion", request={"model": "m", "messages": []})
    session.commit()
    reading = read_loads(session.connection(), dead_before=utcnow())["m"]
    assert reading.mean_output_fill == pytest.approx((0.5 + 1.0) / 2)
    assert reading.mean_completion_tokens == pytest.approx(40)
    assert reading.cache_hit_fraction == pytest.approx(0.25)
