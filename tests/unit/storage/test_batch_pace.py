"""A running batch asks for its next pass when its jobs should be done, if that is sooner
than the interval, so a fast batch is not left finished-but-running for most of one, and
looks again every TAIL_PASS_S until done while its jobs keep finishing."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from scheduler.batches import MIN_PASS_GAP_S, TAIL_PASS_S, BatchRunner
from scheduler.periodic import Wakeup
from storage.models import Tenant
from tests.unit.storage.test_batch_expiry import _runner, _running_batch, _succeed


class RecordingWakeup(Wakeup):
    """A real wakeup that also remembers each `soon`."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[float] = []

    def soon(self, seconds: float) -> None:
        self.requests.append(seconds)
        super().soon(seconds)


def test_a_batch_about_to_finish_asks_for_a_pass_when_it_should_be_done(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
) -> None:
    runner, _ = _runner(sessions, tmp_path)
    runner.wakeup = wakeup = RecordingWakeup()
    batch, job_ids = _running_batch(session, tenant, 10)
    runner.advance(batch.id)
    assert wakeup.requests == []  # no pace known yet
    runner.advance(batch.id)
    assert wakeup.requests == []  # nothing finished since: no pace
    for job_id in job_ids[:6]:
        _succeed(session, job_id)
    runner.advance(batch.id)
    # Six finished within a few milliseconds, four to go: well inside the 1 s interval,
    # and never sooner than the floor.
    [seconds] = wakeup.requests
    assert MIN_PASS_GAP_S <= seconds < runner.settings.batch_poll_interval_s


def test_a_slow_batch_keeps_the_interval(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
) -> None:
    runner, _ = _runner(sessions, tmp_path)
    runner.settings = runner.settings.model_copy(update={"batch_poll_interval_s": 1e-6})
    runner.wakeup = wakeup = RecordingWakeup()
    batch, job_ids = _running_batch(session, tenant, 10)
    runner.advance(batch.id)
    _succeed(session, job_ids[0])
    runner.advance(batch.id)
    # Nine left at one per pass: far beyond an interval this short.
    assert wakeup.requests == []
    assert batch.id in runner._last_count
    for job_id in job_ids[1:]:
        _succeed(session, job_id)
    runner.advance(batch.id)
    assert runner._last_count == {}  # finished: nothing kept


def _batch_in_its_tail(sessions: sessionmaker[Session], session: Session, tenant: Tenant,
                       tmp_path: Path) -> tuple[BatchRunner, RecordingWakeup, str]:
    """A runner whose last pass found 6 of a batch's 10 jobs done within milliseconds."""
    runner, _ = _runner(sessions, tmp_path)
    runner.wakeup = wakeup = RecordingWakeup()
    batch, job_ids = _running_batch(session, tenant, 10)
    runner.advance(batch.id)
    for job_id in job_ids[:6]:
        _succeed(session, job_id)
    runner.advance(batch.id)
    wakeup.requests.clear()
    return runner, wakeup, batch.id


def test_a_batch_in_its_tail_is_looked_at_again_soon_between_bursts(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
) -> None:
    runner, wakeup, batch_id = _batch_in_its_tail(sessions, session, tenant, tmp_path)
    # A pass between two bursts (an embeddings step ends ~90 jobs at once) sees nothing
    # new: the batch is still expected within the interval, so it is looked at again soon.
    runner.advance(batch_id)
    assert wakeup.requests == [TAIL_PASS_S]


def test_a_stalled_tail_falls_back_to_the_interval(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
) -> None:
    runner, wakeup, batch_id = _batch_in_its_tail(sessions, session, tenant, tmp_path)
    # Nothing finished for a whole interval (its worker is gone): no more quick passes.
    when, count, is_tail = runner._last_count[batch_id]
    assert is_tail
    runner._last_count[batch_id] = (when - runner.settings.batch_poll_interval_s, count,
                                    is_tail)
    runner.advance(batch_id)
    assert wakeup.requests == []
