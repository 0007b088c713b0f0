"""No job stays `running` without a live owner: real workers, broker and PostgreSQL.

A worker drained with jobs longer than its drain timeout hands them back itself; one
frozen by SIGSTOP leaves them to the reconciler, which hands them back once the worker's
heartbeat is older than the timeout; one killed leaves them too, but its pid names no
process of this host any more, so they go back at the next pass. Every time a successor
runs every job, and each one is stored as succeeded exactly once (counted by a trigger on
the jobs table).
"""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from core.kafka import make_producer
from scheduler.reconciler import Reconciler
from storage.models import Job, JobStatus, WorkerHeartbeat, utcnow
from storage.workers import live_worker_ids
from tests.utils.worker_service import Service, job_bodies

# Short, so the tests wait seconds for a death, not the production half-minute.
LIVENESS = {"worker_heartbeat_interval_s": 0.5, "worker_heartbeat_timeout_s": 4.0}


def _two_running(rows: dict[str, Job]) -> bool:
    return sum(j.status == JobStatus.RUNNING for j in rows.values()) == 2


def _count_completion_writes(svc: Service) -> None:
    """A trigger that records every UPDATE leaving a job row `succeeded`."""
    with svc.sessions() as session:
        session.execute(sa.text("CREATE TABLE completion_writes (job_id text NOT NULL)"))
        session.execute(sa.text(
            "CREATE FUNCTION record_completion() RETURNS trigger AS $$ BEGIN "
            "INSERT INTO completion_writes (job_id) VALUES (NEW.id); RETURN NEW; END $$ "
            "LANGUAGE plpgsql"
        ))
        session.execute(sa.text(
            "CREATE TRIGGER jobs_completion_writes AFTER UPDATE ON jobs FOR EACH ROW "
            "WHEN (NEW.status = 'succeeded') EXECUTE FUNCTION record_completion()"
        ))
        session.commit()


def _completion_writes(svc: Service) -> dict[str, int]:
    with svc.sessions() as session:
        rows = session.execute(
            sa.text("SELECT job_id, count(*) FROM completion_writes GROUP BY job_id")
        ).all()
    return dict(rows)


def _workers(svc: Service) -> list[str]:
    with svc.sessions() as session:
        return list(session.scalars(sa.select(WorkerHeartbeat.id)))


def _is_alive(svc: Service, worker_id: str, *, within_s: float) -> bool:
    """Whether the worker beat within the last `within_s` seconds."""
    with svc.sessions() as session:
        dead_before = utcnow() - timedelta(seconds=within_s)
        return worker_id in live_worker_ids(session, dead_before=dead_before)


def _reconcile(svc: Service) -> int:
    """One reconciler pass, as the scheduler role runs it."""
    producer = make_producer(svc.settings)
    try:
        return Reconciler(svc.settings, svc.sessions, producer).republish_stale()
    finally:
        producer.close()


def test_a_drained_worker_hands_back_jobs_longer_than_its_drain_timeout(service) -> None:
    # Jobs of 900 tokens (0.5 s of the tiny model's steps at 2 sequences, on a quiet Zen 4)
    # against 50 ms: the drain cannot finish them.
    svc = service(worker_drain_timeout_s=0.05, worker_max_inflight=2, engine_max_num_seqs=2,
                  **LIVENESS)
    _count_completion_writes(svc)
    job_ids = svc.submit("normal", job_bodies(4, tag="handback", max_tokens=900,
                                              ignore_eos=True))
    worker = svc.start_worker()
    svc.wait_for("a heartbeat row", lambda: len(_workers(svc)) == 1)
    svc.wait_for("jobs running", lambda: svc.count_status(job_ids, JobStatus.RUNNING) == 2)
    running = [i for i, j in svc.jobs(job_ids).items() if j.status == JobStatus.RUNNING]
    worker.process.terminate()
    assert worker.process.wait(120) == 0, worker.log_tail()

    # Back in the queue at once, by the worker itself: no reconciler has run.
    after = svc.jobs(job_ids)
    assert {i: after[i].status for i in running} == dict.fromkeys(running, JobStatus.QUEUED)
    assert not any(j.status == JobStatus.RUNNING for j in after.values())
    assert all(after[i].worker_id is None for i in running)
    assert _workers(svc) == [], "a worker that stops deletes its heartbeat row"

    successor = svc.start_worker()
    done = svc.wait_terminal(job_ids, timeout=300)
    assert all(j.status == JobStatus.SUCCEEDED and j.result for j in done.values())
    assert _completion_writes(svc) == dict.fromkeys(job_ids, 1)
    for job_id in running:  # claimed by the drained worker, then by its successor
        assert done[job_id].attempts == 2
    assert successor.stop() == 0, successor.log_tail()


def test_the_reconciler_hands_back_the_jobs_of_a_frozen_worker(service) -> None:
    """A worker frozen by SIGSTOP is alive as a process, so only its heartbeat tells: its
    jobs stay put while the beat is fresh and are handed back once it has aged."""
    svc = service(worker_max_inflight=2, engine_max_num_seqs=2, **LIVENESS)
    _count_completion_writes(svc)
    job_ids = svc.submit("high", job_bodies(4, tag="orphan", max_tokens=900, ignore_eos=True))
    worker = svc.start_worker()
    at_freeze = svc.freeze_when(worker, "jobs running", job_ids, _two_running)
    try:
        running = [i for i, j in at_freeze.items() if j.status == JobStatus.RUNNING]
        (frozen_id,) = {at_freeze[i].worker_id for i in running}
        assert _workers(svc) == [frozen_id]

        # While the heartbeat is fresh the worker may only be slow: its jobs stay put. (On
        # a machine too loaded to get here within the timeout, this check has nothing to
        # see.)
        if _is_alive(svc, frozen_id, within_s=3.0):
            _reconcile(svc)
            assert svc.count_status(running, JobStatus.RUNNING) == len(running)
        svc.wait_for("the heartbeat to age past the timeout",
                     lambda: not _is_alive(svc, frozen_id, within_s=4.5))
        assert _reconcile(svc) == len(running)
        after = svc.jobs(job_ids)
        assert not any(j.status == JobStatus.RUNNING for j in after.values())
        assert all(after[i].status == JobStatus.QUEUED and after[i].attempts == 1
                   for i in running)
        assert _workers(svc) == [], "the dead worker's row is pruned"
    finally:
        worker.kill()  # SIGKILL ends a stopped process too

    successor = svc.start_worker()
    done = svc.wait_terminal(job_ids, timeout=300)
    assert all(j.status == JobStatus.SUCCEEDED and j.result for j in done.values())
    # Kafka redelivered the frozen worker's records and the reconciler re-published the
    # jobs: two copies of each, one run, one stored result.
    assert _completion_writes(svc) == dict.fromkeys(job_ids, 1)
    assert successor.stop() == 0, successor.log_tail()


def test_the_jobs_of_a_killed_worker_of_this_host_are_handed_back_at_once(service) -> None:
    """SIGKILL leaves the row behind, but its pid names no process any more: the next
    reconciler pass hands the jobs back without waiting out the heartbeat timeout."""
    svc = service(worker_max_inflight=2, engine_max_num_seqs=2,
                  worker_heartbeat_interval_s=0.5, worker_heartbeat_timeout_s=600.0)
    _count_completion_writes(svc)
    job_ids = svc.submit("high", job_bodies(4, tag="killed", max_tokens=900, ignore_eos=True))
    worker = svc.start_worker()
    # Frozen first, so the rows read are the rows the kill leaves.
    at_kill = svc.freeze_when(worker, "jobs running", job_ids, _two_running)
    worker.kill()
    running = [i for i, j in at_kill.items() if j.status == JobStatus.RUNNING]
    (dead_id,) = {at_kill[i].worker_id for i in running}
    assert _is_alive(svc, dead_id, within_s=600.0), "SIGKILL leaves the row behind"

    assert _reconcile(svc) == len(running)
    after = svc.jobs(job_ids)
    assert all(after[i].status == JobStatus.QUEUED and after[i].attempts == 1 for i in running)
    assert _workers(svc) == [], "the dead worker's row is gone"

    successor = svc.start_worker()
    done = svc.wait_terminal(job_ids, timeout=300)
    assert all(j.status == JobStatus.SUCCEEDED and j.result for j in done.values())
    assert _completion_writes(svc) == dict.fromkeys(job_ids, 1)
    assert successor.stop() == 0, successor.log_tail()
