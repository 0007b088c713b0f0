"""A running batch's counts move every pass; its token usage at most every USAGE_REFRESH_S,
and exactly when it ends."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

import scheduler.batches
from storage.batches import Batch, BatchStatus
from storage.models import Tenant
from tests.unit.storage.test_batch_expiry import _runner, _running_batch, _succeed


def _reread(session: Session, batch_id: str) -> Batch:
    session.expire_all()
    batch = session.get(Batch, batch_id)
    assert batch is not None
    return batch


def test_usage_is_summed_once_per_refresh_interval_and_exactly_at_the_end(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
) -> None:
    runner, _ = _runner(sessions, tmp_path)
    batch, job_ids = _running_batch(session, tenant, 3)
    _succeed(session, job_ids[0])  # 1 prompt + 1 completion token each
    runner.advance(batch.id)
    first = _reread(session, batch.id)
    assert (first.num_completed, first.input_tokens) == (1, 1)
    _succeed(session, job_ids[1])
    runner.advance(batch.id)  # within the interval: counts move, usage waits
    again = _reread(session, batch.id)
    assert (again.num_completed, again.input_tokens) == (2, 1)
    _succeed(session, job_ids[2])
    runner.advance(batch.id)
    done = _reread(session, batch.id)
    assert done.status == BatchStatus.COMPLETED
    assert (done.num_completed, done.input_tokens, done.output_tokens) == (3, 3, 3)


def test_usage_follows_every_pass_once_the_interval_has_passed(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scheduler.batches, "USAGE_REFRESH_S", 0.0)
    runner, _ = _runner(sessions, tmp_path)
    batch, job_ids = _running_batch(session, tenant, 3)
    for done, job_id in enumerate(job_ids[:2], start=1):
        _succeed(session, job_id)
        runner.advance(batch.id)
        assert _reread(session, batch.id).input_tokens == done


def test_a_batch_finished_elsewhere_leaves_no_refresh_time_behind(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
) -> None:
    runner, _ = _runner(sessions, tmp_path)
    other, _ = _runner(sessions, tmp_path)  # a second scheduler
    batch, job_ids = _running_batch(session, tenant, 1)
    runner.step()
    assert batch.id in runner._usage_summed_at
    _succeed(session, job_ids[0])
    other.step()  # finishes it
    assert _reread(session, batch.id).status == BatchStatus.COMPLETED
    runner.step()
    assert runner._usage_summed_at == {}
