"""Grouped admission (api.job_writer): shared commits, and each request's own outcome."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError
from sqlalchemy import event, func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from api.job_writer import JobWriter
from api.resources import BrokerUnavailable, LazyProducer, ServiceStopping
from core.settings import Settings
from storage.jobs import IdempotencyKeyTaken, new_job
from storage.models import Job
from storage.tenants import create_tenant
from tests.utils.api import RecordingProducer

NUM_CONCURRENT = 32


class _DownHandle:
    """A producer handle whose broker is down: refused before anything is written."""

    def get(self) -> RecordingProducer:
        raise BrokerUnavailable("broker down (test)")

    @contextmanager
    def accepting(self) -> Iterator[str | None]:
        yield None  # never reached: the group is refused before it is written


@pytest.fixture
def tenant_id(sessions: sessionmaker[Session]) -> str:
    with sessions() as session:
        tenant = create_tenant(session, name="acme")
        session.commit()
        return tenant.id


@pytest.fixture
def writer(make_settings: Callable[..., Settings], sessions: sessionmaker[Session]):
    # A long window, so concurrent writes on a loaded machine still meet in one group.
    writer = JobWriter(make_settings(), sessions, publish_timeout_s=5.0, window_s=0.2,
                       quiet_s=0.2)
    yield writer
    writer.close()


def _job(tenant_id: str, i: int, key: str | None = None) -> Job:
    return new_job(tenant_id=tenant_id, priority="normal", model="m", kind="text_completion",
                   request={"prompt": f"p{i}", "max_tokens": 1}, idempotency_key=key,
                   published=True)


def _num_jobs(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count(Job.id))) or 0


def _write_together(writer: JobWriter, jobs: list[Job], producer) -> list[object]:
    """Write jobs from as many threads at once; each one's job or exception."""
    barrier = threading.Barrier(len(jobs))

    def one(job: Job) -> object:
        barrier.wait(60)  # a thread that died first breaks it: no wait for ever
        try:
            return writer.write(job, producer)
        except Exception as e:
            return e

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def test_concurrent_submissions_share_commits_and_each_gets_its_job(
    writer: JobWriter, sessions: sessionmaker[Session], producer: RecordingProducer,
    tenant_id: str,
) -> None:
    commits = []
    engine = sessions.kw["bind"]
    event.listen(engine, "commit", lambda conn: commits.append(1))
    jobs = [_job(tenant_id, i) for i in range(NUM_CONCURRENT)]
    answers = _write_together(writer, jobs, producer)
    assert answers == jobs
    assert _num_jobs(sessions) == NUM_CONCURRENT
    assert len(producer.records) == NUM_CONCURRENT
    assert len(commits) < NUM_CONCURRENT / 2, "submissions were committed one by one"


def test_a_broker_that_does_not_take_the_records_leaves_no_rows(
    writer: JobWriter, sessions: sessionmaker[Session], producer: RecordingProducer,
    tenant_id: str,
) -> None:
    producer.is_down = True
    answers = _write_together(writer, [_job(tenant_id, i) for i in range(8)], producer)
    assert all(isinstance(a, KafkaTimeoutError) for a in answers), answers
    assert _num_jobs(sessions) == 0


def test_a_broker_known_down_refuses_before_writing(
    writer: JobWriter, sessions: sessionmaker[Session], tenant_id: str
) -> None:
    with pytest.raises(BrokerUnavailable):
        writer.write(_job(tenant_id, 0), _DownHandle())
    assert _num_jobs(sessions) == 0


def test_a_taken_idempotency_key_fails_only_its_own_request(
    writer: JobWriter, sessions: sessionmaker[Session], producer: RecordingProducer,
    tenant_id: str,
) -> None:
    writer.write(_job(tenant_id, 0, key="k-1"), producer)
    jobs = [_job(tenant_id, 1, key="k-1"), *(_job(tenant_id, i) for i in range(2, 10))]
    answers = _write_together(writer, jobs, producer)
    assert isinstance(answers[0], IdempotencyKeyTaken)
    assert answers[1:] == jobs[1:]
    assert _num_jobs(sessions) == 9


def test_enqueue_from_the_event_loop_refuses_a_down_broker_on_the_writer_thread(
    writer: JobWriter, sessions: sessionmaker[Session], tenant_id: str
) -> None:
    """enqueue never blocks; the group is refused before its insert, as write's would be."""
    with pytest.raises(BrokerUnavailable):
        writer.enqueue(_job(tenant_id, 0), _DownHandle()).result(timeout=5)
    assert _num_jobs(sessions) == 0


def test_a_request_that_stops_waiting_leaves_its_group_answered(
    writer: JobWriter, sessions: sessionmaker[Session], producer: RecordingProducer,
    tenant_id: str,
) -> None:
    """A cancelled await (client gone, timeout) must not break the answers of its group."""
    jobs = [_job(tenant_id, i) for i in range(4)]

    async def scenario() -> list[object]:
        waits = [asyncio.ensure_future(asyncio.wrap_future(writer.enqueue(job, producer)))
                 for job in jobs]
        await asyncio.sleep(0)
        waits[0].cancel()
        return await asyncio.gather(*waits, return_exceptions=True)

    answers = asyncio.run(scenario())
    assert isinstance(answers[0], asyncio.CancelledError)
    assert answers[1:] == jobs[1:]
    # The cancelled request's job was stored and produced all the same (it had been taken).
    assert _num_jobs(sessions) == 4
    assert len(producer.records) == 4


def test_a_group_closes_once_no_more_submissions_arrive(
    make_settings: Callable[..., Settings], sessions: sessionmaker[Session],
    producer: RecordingProducer, tenant_id: str,
) -> None:
    """A lone job is written after the quiet gap, not held for the whole window."""
    writer = JobWriter(make_settings(), sessions, publish_timeout_s=5.0, window_s=3600.0,
                       quiet_s=0.01)
    try:
        job = _job(tenant_id, 0)
        assert writer.enqueue(job, producer).result(timeout=60) is job
    finally:
        writer.close()


def test_submissions_waiting_while_the_writer_is_busy_form_one_group(
    make_settings: Callable[..., Settings], sessions: sessionmaker[Session],
    producer: RecordingProducer, tenant_id: str,
) -> None:
    """However short the quiet gap, what queued meanwhile is written as one group."""
    writer = JobWriter(make_settings(), sessions, publish_timeout_s=5.0, quiet_s=0.0)
    first_insert, release = threading.Event(), threading.Event()
    commits = []
    engine = sessions.kw["bind"]

    def hold_the_first(*args: object) -> None:
        if not first_insert.is_set():
            first_insert.set()
            release.wait(60)

    event.listen(engine, "before_cursor_execute", hold_the_first)
    event.listen(engine, "commit", lambda conn: commits.append(1))
    jobs = [_job(tenant_id, i) for i in range(1 + NUM_CONCURRENT)]
    try:
        answers = [writer.enqueue(jobs[0], producer)]
        assert first_insert.wait(60)
        answers += [writer.enqueue(job, producer) for job in jobs[1:]]
        release.set()
        assert [a.result(timeout=60) for a in answers] == jobs
    finally:
        release.set()
        writer.close()
    assert len(commits) == 2


@dataclass
class _StopWhileAcking(RecordingProducer):
    """The stop comes while the group's records wait for their acknowledgements."""

    handle: LazyProducer | None = None

    @contextmanager
    def accepting(self) -> Iterator[str | None]:
        assert self.handle is not None
        with self.handle.accepting() as refusal:
            yield refusal

    def send(self, topic: str, key: bytes | None = None, value: bytes | None = None) -> Any:
        acked = super().send(topic, key=key, value=value)
        assert self.handle is not None
        self.handle.refuse("stopping (test)")
        return acked


def test_a_stop_before_the_answer_refuses_and_withdraws_the_job(
    writer: JobWriter, make_settings: Callable[..., Settings],
    sessions: sessionmaker[Session], tenant_id: str,
) -> None:
    """Checking for a stop and accepting are one step: a job whose stop came before its
    answer is refused as stopping (503), and its row is gone."""
    handle = LazyProducer(make_settings())
    producer = _StopWhileAcking(handle=handle)
    with pytest.raises(ServiceStopping):
        writer.write(_job(tenant_id, 0), producer)
    assert len(producer.records) == 1, "the record was sent before the stop"
    assert _num_jobs(sessions) == 0
    # Later submissions are refused before anything is written.
    with pytest.raises(ServiceStopping):
        writer.write(_job(tenant_id, 1), handle)
    assert len(producer.records) == 1


def test_a_commit_that_raised_after_storing_leaves_no_row_once_the_database_answers(
    writer: JobWriter, sessions: sessionmaker[Session], producer: RecordingProducer,
    tenant_id: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """PostgreSQL dying mid-COMMIT may keep the rows though the commit raised: the request
    hears the error, nothing is produced, and the row, which no worker would ever see, is
    withdrawn once the database answers again (here after one more failed try), not left
    queued for the reconciler."""
    lost = OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))
    failures = {"commit": 1, "delete": 1}

    def answer_lost(session: Session) -> None:
        if failures["commit"]:
            failures["commit"] -= 1
            raise lost

    def still_down(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.lstrip().upper().startswith("DELETE") and failures["delete"]:
            failures["delete"] -= 1
            raise lost

    event.listen(sessions, "after_commit", answer_lost)
    event.listen(sessions.kw["bind"], "before_cursor_execute", still_down)
    caplog.set_level(logging.WARNING, logger="api.job_writer")
    refused = _job(tenant_id, 0)
    with pytest.raises(OperationalError):
        writer.write(refused, producer)
    assert producer.records == []
    # Until withdrawn, its row is no job: an Idempotency-Key replay must not adopt it.
    assert writer.is_doubtful(refused.id)
    deadline = time.monotonic() + 30
    while "withdrew 1 refused job(s)" not in caplog.text:
        assert time.monotonic() < deadline, "the refused job's stored row was not withdrawn"
        time.sleep(0.05)
    assert failures == {"commit": 0, "delete": 0}
    assert _num_jobs(sessions) == 0
    assert not writer.is_doubtful(refused.id)
    job = _job(tenant_id, 1)
    assert writer.write(job, producer) == job
    assert _num_jobs(sessions) == 1
