"""The reconciler's decisions on SQLite, with a real producer whose broker is down.

No broker runs in unit tests, which is itself a case the reconciler must handle: every
send times out (after `max_block_ms`), so what it decides about each row shows without
any message getting out. A row no message can carry is failed before the producer is
asked; rows the broker could not take stay as they were for the next pass.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.kafka import make_producer
from core.settings import Settings
from core.worker_ids import is_known_dead, local_pid, new_worker_id
from scheduler.job_publisher import describe, publish_jobs
from scheduler.reconciler import Reconciler
from storage.db import create_db_engine, session_factory
from storage.jobs import create_job, get_job, mark_published, mark_running
from storage.models import Base, Job, JobStatus, Tenant, utcnow
from storage.webhooks import Delivery
from storage.workers import record_heartbeat, worker_ids
from tests.utils.api import committed_tenant

POISON = "x\ud800y"  # a lone surrogate: valid in a Python str, not encodable as UTF-8


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """SQLite, and a broker address nothing listens on."""
    return Settings(data_dir=tmp_path, kafka_bootstrap_servers="127.0.0.1:1", model="m",
                    requeue_after_s=60, worker_heartbeat_interval_s=1,
                    worker_heartbeat_timeout_s=10, job_max_attempts=2)


@pytest.fixture
def sessions(settings: Settings) -> Iterator[sessionmaker[Session]]:
    """Sessions on a fresh SQLite file with every table."""
    engine = create_db_engine(settings.database_url)
    Base.metadata.create_all(engine)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture
def tenant(sessions: sessionmaker[Session]) -> Tenant:
    """A committed tenant."""
    return committed_tenant(sessions)


@pytest.fixture
def producer(settings: Settings) -> Iterator[KafkaProducer]:
    """A real producer that gives up on the absent broker after a fifth of a second."""
    # api_version given: the constructor does not probe the broker.
    producer = make_producer(settings, api_version=(2, 5), max_block_ms=200)
    yield producer
    producer.close(timeout=1)


def add_job(session: Session, tenant: Tenant, prompt: str, *, age_s: float = 600,
            callback_url: str | None = None) -> str:
    """A queued job created `age_s` ago and never published; its id."""
    job = create_job(session, tenant_id=tenant.id, priority="normal", model="m",
                     kind="text_completion", request={"prompt": prompt},
                     callback_url=callback_url)
    job.created_at = utcnow() - timedelta(seconds=age_s)
    session.commit()
    return job.id


def load(sessions: sessionmaker[Session], job_id: str) -> Job:
    """The job as committed."""
    with sessions() as session:
        job = get_job(session, job_id=job_id)
        assert job is not None
        return job


def test_a_poison_row_is_unpublishable_and_a_dead_broker_leaves_the_rest_unsent(
    sessions: sessionmaker[Session], tenant: Tenant, settings: Settings,
    producer: KafkaProducer,
) -> None:
    with sessions() as session:
        ids = [add_job(session, tenant, p) for p in (POISON, "fine", "also fine")]
        jobs = list(session.scalars(select(Job).order_by(Job.created_at)))
    output = publish_jobs(producer, settings, jobs, timeout_s=1)
    assert list(output.id_to_unpublishable_reason) == [ids[0]]
    assert "\\ud800" in output.id_to_unpublishable_reason[ids[0]]
    assert isinstance(output.broker_error, KafkaTimeoutError)
    # After the first timeout the rest are not tried: one wait per page, not per job.
    assert (output.published_ids, output.unsent_ids) == ([], ids[1:])
    with pytest.raises(RuntimeError, match="did not take 2 job"):
        output.raise_for_broker()


def test_a_job_of_a_model_no_longer_served_is_unpublishable_without_asking_the_broker(
    sessions: sessionmaker[Session], tenant: Tenant, settings: Settings,
    producer: KafkaProducer,
) -> None:
    with sessions() as session:
        job_id = add_job(session, tenant, "hi")
        session.get(Job, job_id).model = "retired-model"  # type: ignore[union-attr]
        session.commit()
        jobs = list(session.scalars(select(Job)))
    output = publish_jobs(producer, settings, jobs, timeout_s=1)
    assert output.id_to_unpublishable_reason == {
        job_id: "model 'retired-model' is not served (served: m)"
    }
    assert output.broker_error is None and output.unsent_ids == []


def test_reconciler_fails_the_poison_row_and_keeps_the_others_for_the_next_pass(
    sessions: sessionmaker[Session], tenant: Tenant, settings: Settings,
    producer: KafkaProducer,
) -> None:
    with sessions() as session:
        poison = add_job(session, tenant, POISON, callback_url="https://example.com/hook")
        fine = add_job(session, tenant, "fine")
    with pytest.raises(RuntimeError, match="next pass retries them"):
        Reconciler(settings, sessions, producer).republish_stale()
    failed = load(sessions, poison)
    assert failed.status is JobStatus.FAILED and failed.error is not None
    assert failed.error["code"] == "unpublishable" and failed.finished_at is not None
    failed.error["message"].encode()  # stored in a form every client can read
    with sessions() as session:  # its webhook was enqueued with the failure
        assert session.scalars(select(Delivery.job_id)).all() == [poison]
    kept = load(sessions, fine)
    assert (kept.status, kept.queued_at) == (JobStatus.QUEUED, None)


def test_orphans_are_handed_back_even_while_the_broker_is_down(
    sessions: sessionmaker[Session], tenant: Tenant, settings: Settings,
    producer: KafkaProducer,
) -> None:
    with sessions() as session:
        record_heartbeat(session, worker_id="alive")
        record_heartbeat(session, worker_id="dead", now=utcnow() - timedelta(seconds=60))
        once, spent, live = (add_job(session, tenant, p) for p in ("once", "spent", "live"))
        mark_published(session, job_ids=[once, spent, live])  # not stale as queued jobs
        mark_running(session, job_id=once, worker_id="dead")
        mark_running(session, job_id=spent, worker_id="gone")
        mark_running(session, job_id=spent, worker_id="dead")
        mark_running(session, job_id=live, worker_id="alive")
        session.commit()
    with pytest.raises(RuntimeError):  # re-publishing the requeued job fails, not the rest
        Reconciler(settings, sessions, producer).republish_stale()
    assert load(sessions, once).status is JobStatus.QUEUED
    lost = load(sessions, spent)
    assert lost.status is JobStatus.FAILED and lost.error is not None
    assert lost.error["code"] == "worker_lost" and "2 attempt" in lost.error["message"]
    assert load(sessions, live).status is JobStatus.RUNNING


def test_jobs_of_a_local_worker_whose_process_is_gone_are_handed_back_at_once(
    sessions: sessionmaker[Session], tenant: Tenant, settings: Settings,
    producer: KafkaProducer,
) -> None:
    """After a crash or a restart of the whole stack, rows naming pids of this host that no
    longer run are dead now: their jobs go back in the first pass, not after the timeout."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process
    host = socket.gethostname()
    gone, alive = f"{host}-{child.pid}-abc123", f"{host}-{os.getpid()}-def456"
    elsewhere = f"{host}x-{child.pid}-abc123"  # another host: only the timeout tells
    with sessions() as session:
        jobs = {w: add_job(session, tenant, w) for w in (gone, alive, elsewhere)}
        mark_published(session, job_ids=list(jobs.values()))
        for worker_id, job_id in jobs.items():
            record_heartbeat(session, worker_id=worker_id)  # all beat just now
            mark_running(session, job_id=job_id, worker_id=worker_id)
        session.commit()
    with pytest.raises(RuntimeError):  # the broker is down: re-publishing fails
        Reconciler(settings, sessions, producer).republish_stale()
    assert load(sessions, jobs[gone]).status is JobStatus.QUEUED
    assert load(sessions, jobs[alive]).status is JobStatus.RUNNING
    assert load(sessions, jobs[elsewhere]).status is JobStatus.RUNNING
    with sessions() as session:
        assert worker_ids(session) == sorted([alive, elsewhere])


def test_worker_ids_name_this_host_and_pid_and_differ_per_start() -> None:
    first, second = new_worker_id(), new_worker_id()
    assert first != second
    assert local_pid(first) == local_pid(second) == os.getpid()
    assert not is_known_dead(first)
    assert local_pid(f"{socket.gethostname()}-123") == 123  # ids from before the token
    assert local_pid("other-host-123-abc") is None


def test_passes_come_often_enough_to_notice_a_dead_worker(
    sessions: sessionmaker[Session], settings: Settings, producer: KafkaProducer
) -> None:
    reconciler = Reconciler(settings, sessions, producer)
    assert reconciler.interval_s == 5.0  # half the heartbeat timeout, below requeue/2
    settings.worker_heartbeat_timeout_s = 600
    assert reconciler.interval_s == 30.0  # half of requeue_after_s


def test_a_reason_quoting_the_bad_text_is_stored_escaped() -> None:
    reason = describe(ValueError(f"cannot send {POISON}"))
    assert reason == "ValueError: cannot send x\\ud800y"
    reason.encode()  # would raise had the surrogate come through
