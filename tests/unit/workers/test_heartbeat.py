"""The worker's heartbeat thread and its hand-back of unfinished jobs, on a SQLite file."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from storage.db import create_db_engine, session_factory
from storage.jobs import create_job, get_job, mark_running
from storage.models import Base, JobStatus, WorkerHeartbeat
from storage.tenants import create_tenant
from workers.inference import heartbeat as heartbeat_module
from workers.inference.heartbeat import Heartbeat
from workers.inference.job_store import JobStore
from workers.inference.liveness import LoopPulse
from workers.inference.service_rate import Pace, WorkLeft


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """Sessions on a fresh SQLite file with every table."""
    engine = create_db_engine(f"sqlite:///{tmp_path / 'db' / 'hb.db'}")
    Base.metadata.create_all(engine)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture
def empty_sessions(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """Sessions on a SQLite file without tables: every statement fails."""
    engine = create_db_engine(f"sqlite:///{tmp_path / 'db' / 'empty.db'}")
    yield session_factory(engine)
    engine.dispose()


def rows(sessions: sessionmaker[Session]) -> list[WorkerHeartbeat]:
    """The workers table as committed."""
    with sessions() as session:
        return list(session.scalars(select(WorkerHeartbeat)))


def wait_until(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll `check` (the machine may be busy: no tight timing is asserted)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_start_writes_the_row_beats_move_it_and_stop_deletes_it(
    sessions: sessionmaker[Session],
) -> None:
    heartbeat = Heartbeat(sessions, worker_id="host-1", interval_s=0.05)
    heartbeat.start()
    try:
        (first,) = rows(sessions)  # before start returned: no job is ever claimed row-less
        assert first.id == "host-1"
        wait_until("a later beat",
                   lambda: rows(sessions)[0].heartbeat_at > first.heartbeat_at)
        # A reconciler pruned the row while the worker was stalled: the next beat is back.
        with sessions() as session:
            session.delete(session.get(WorkerHeartbeat, "host-1"))
            session.commit()
        wait_until("the row to come back", lambda: len(rows(sessions)) == 1)
        assert heartbeat.is_running
    finally:
        heartbeat.stop()
    assert not heartbeat.is_running
    assert rows(sessions) == []


def test_a_database_that_cannot_take_the_first_beat_fails_the_start(
    empty_sessions: sessionmaker[Session],
) -> None:
    heartbeat = Heartbeat(empty_sessions, worker_id="host-1", interval_s=1.0)
    with pytest.raises(OperationalError):
        heartbeat.start()
    assert not heartbeat.is_running
    heartbeat.stop()  # logs that the row cannot be deleted; does not raise


def test_interval_must_be_positive(sessions: sessionmaker[Session]) -> None:
    with pytest.raises(ValueError, match="interval"):
        Heartbeat(sessions, worker_id="w", interval_s=0)


def test_release_hands_back_this_workers_running_jobs(sessions: sessionmaker[Session]) -> None:
    store = JobStore(sessions, redis.Redis(), prefix="t", result_cache_ttl_s=0)
    with sessions() as session:
        tenant = create_tenant(session, name="acme")
        job_ids = [
            create_job(session, tenant_id=tenant.id, priority="low", model="m",
                       kind="text_completion", request={"prompt": f"p{i}"}).id
            for i in range(3)
        ]
        mark_running(session, job_id=job_ids[0], worker_id="me")
        mark_running(session, job_id=job_ids[1], worker_id="me")
        mark_running(session, job_id=job_ids[1], worker_id="other")  # redelivered elsewhere
        session.commit()
    assert store.release(job_ids, worker_id="me") == 1
    with sessions() as session:
        statuses = [get_job(session, job_id=i).status for i in job_ids]  # type: ignore[union-attr]
    assert statuses == [JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.QUEUED]


def test_release_logs_instead_of_raising_when_the_database_fails(
    empty_sessions: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    store = JobStore(empty_sessions, redis.Redis(), prefix="t", result_cache_ttl_s=0)
    assert store.release(["job_1"], worker_id="me") == 0
    assert "cannot hand 1 job(s) back" in caplog.text


def test_a_timeout_shorter_than_two_beats_is_refused() -> None:
    with pytest.raises(ValueError, match="at least twice worker_heartbeat_interval_s"):
        Settings(worker_heartbeat_interval_s=5, worker_heartbeat_timeout_s=9)
    assert Settings(worker_heartbeat_interval_s=5, worker_heartbeat_timeout_s=10)


def test_a_stalled_poll_loop_stops_the_beats_and_the_liveness_file(
    sessions: sessionmaker[Session], tmp_path: Path,
) -> None:
    """Once the loop's pulse is silent past the stall timeout, neither the row nor the
    liveness file is stamped (the worker looks dead); a pulse again resumes both."""
    pulse, path = LoopPulse(), tmp_path / "run" / "worker.alive"
    heartbeat = Heartbeat(sessions, worker_id="host-1", interval_s=0.05, pulse=pulse,
                          loop_stall_timeout_s=0.3, liveness_file=path)
    heartbeat.start()
    try:
        assert path.exists(), "stamped with the first beat"
        wait_until("the stall to be noticed", lambda: heartbeat.num_skipped_beats >= 1)
        stamps = rows(sessions)[0].heartbeat_at, path.stat().st_mtime_ns
        wait_until("more ticks of the stall", lambda: heartbeat.num_skipped_beats >= 3)
        assert (rows(sessions)[0].heartbeat_at, path.stat().st_mtime_ns) == stamps
        pulse.beat()
        wait_until("the beats to resume", lambda: rows(sessions)[0].heartbeat_at > stamps[0])
        assert path.stat().st_mtime_ns > stamps[1]
    finally:
        heartbeat.stop()


def test_each_beat_carries_the_pace_and_the_work_left(sessions: sessionmaker[Session]) -> None:
    left = [WorkLeft(2, 50, 30)]
    heartbeat = Heartbeat(sessions, worker_id="host-1", interval_s=0.05, model="m",
                          pace=lambda: Pace(100.0, 0.01, left[0], solo_step_s=0.004))
    with heartbeat:
        (row,) = rows(sessions)
        assert (row.model, row.tokens_per_s, row.num_requests_left, row.num_tokens_to_compute,
                row.num_output_tokens_left, row.solo_step_s) == ("m", 100.0, 2, 50, 30, 0.004)
        left[0] = WorkLeft(0, 0, 0)
        wait_until("a beat with nothing left", lambda: rows(sessions)[0].num_requests_left == 0)
        assert rows(sessions)[0].num_tokens_to_compute == 0



def test_a_pace_known_at_last_or_moved_beats_before_the_interval_and_a_steady_one_not(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The estimates read the last beat's pace: a pace known where the last beat had none,
    or moved by more than a quarter, is written at once, not an interval later; a pace that
    holds (or moves less) waits for the interval."""
    monkeypatch.setattr(heartbeat_module, "PACE_NEWS_GAP_S", 0.0)
    paces = [Pace(None, None, WorkLeft(0, 0, 0))]
    heartbeat = Heartbeat(sessions, worker_id="host-1", interval_s=600.0, model="m",
                          pace=lambda: paces[-1], probe_s=0.01)
    with heartbeat:
        first = rows(sessions)[0].heartbeat_at
        time.sleep(0.2)  # twenty probes of a pace still unknown
        assert heartbeat.num_early_beats == 0
        assert rows(sessions)[0].heartbeat_at == first
        paces.append(Pace(500.0, 0.02, WorkLeft(3, 90, 60)))
        wait_until("the pace known", lambda: rows(sessions)[0].tokens_per_s == 500.0)
        assert rows(sessions)[0].num_requests_left == 3
        paces.append(Pace(None, 0.02, WorkLeft(3, 80, 50), tokens_per_s_ahead=600.0))
        time.sleep(0.2)  # +20%: not news
        assert rows(sessions)[0].tokens_per_s == 500.0 and heartbeat.num_early_beats == 1
        paces.append(Pace(None, 0.02, WorkLeft(3, 70, 40), tokens_per_s_ahead=300.0))
        wait_until("the moved pace", lambda: rows(sessions)[0].tokens_per_s == 300.0)
        assert rows(sessions)[0].num_tokens_to_compute == 70
        time.sleep(0.2)
        assert heartbeat.num_early_beats == 2, "one beat per piece of news"


def test_a_moved_pace_beats_at_most_once_per_gap(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pace that keeps swinging is written at most once per PACE_NEWS_GAP_S."""
    monkeypatch.setattr(heartbeat_module, "PACE_NEWS_GAP_S", 3.0)  # far from the sleeps
    swings = iter([100.0, 1000.0] * 100_000)
    heartbeat = Heartbeat(sessions, worker_id="host-1", interval_s=600.0,
                          pace=lambda: Pace(next(swings), 0.01), probe_s=0.01)
    with heartbeat:
        time.sleep(0.5)
        assert heartbeat.num_early_beats == 0, "the first beat was under the gap ago"
        wait_until("a moved pace after the gap", lambda: heartbeat.num_early_beats >= 1)
        assert heartbeat.num_early_beats == 1


def test_a_pace_that_cannot_be_read_leaves_the_beats_going_without_it(
    sessions: sessionmaker[Session],
) -> None:
    """Liveness matters more than the pace: a pace that raises (the engine's stats read
    mid-step, say) is logged, and the row is still stamped at every interval."""
    calls = [0]

    def pace() -> Pace:
        calls[0] += 1
        raise RuntimeError("dictionary changed size during iteration")

    heartbeat = Heartbeat(sessions, worker_id="host-1", interval_s=0.3, pace=pace,
                          probe_s=0.01)
    with heartbeat:
        (row,) = rows(sessions)
        assert row.tokens_per_s is None
        first = row.heartbeat_at
        wait_until("probes that fail", lambda: calls[0] > 5)
        wait_until("the interval's beat", lambda: rows(sessions)[0].heartbeat_at > first)
        assert heartbeat.is_running and heartbeat.num_early_beats == 0
