"""The reconciler through the real broker and PostgreSQL: stale queued jobs, orphaned
running ones, and rows no message can carry."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from kafka import TopicPartition
from prometheus_client import REGISTRY

from core.kafka import ensure_topics, make_consumer, make_producer
from core.messages import JobMessage
from core.settings import Settings
from scheduler import reconciler as reconciler_module
from scheduler.reconciler import Reconciler
from storage.db import create_db_engine, session_factory
from storage.events import cancel_channel
from storage.jobs import complete_job, create_job, get_job, mark_published, mark_running
from storage.models import Base, Job, JobStatus, utcnow
from storage.tenants import create_tenant
from storage.workers import live_worker_ids, record_heartbeat


def _consume_all(settings: Settings, expected: int, timeout: float = 30.0) -> list[JobMessage]:
    # Manual assignment: no group join (which takes seconds on the embedded broker).
    consumer = make_consumer(settings, group_id=f"{settings.topic_prefix}.check")
    consumer.assign([
        TopicPartition(topic, partition)
        for topic in settings.job_topics.values()
        for partition in range(settings.topic_partitions)
    ])
    messages: list[JobMessage] = []
    deadline = time.monotonic() + timeout
    try:
        while len(messages) < expected and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                messages.extend(JobMessage.decode(r.value) for r in records)
        # Anything beyond `expected` would be a duplicate; give it a moment to show up.
        for records in consumer.poll(timeout_ms=1000).values():
            messages.extend(JobMessage.decode(r.value) for r in records)
    finally:
        consumer.close()
    return messages


def test_republishes_stale_and_unpublished_jobs_only(settings) -> None:
    """Old and never-published queued jobs go out again; fresh and finished ones do not."""
    s = settings(requeue_after_s=60)
    engine = create_db_engine(s.database_url)
    Base.metadata.create_all(engine)
    sessions = session_factory(engine)
    ensure_topics(s)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with sessions() as session:
        tenant = create_tenant(session, name="acme")
        jobs = {
            name: create_job(session, tenant_id=tenant.id, priority=priority,
                             model=s.model, kind="chat.completion", request=body)
            for name, priority in [("stale", "high"), ("never", "low"), ("fresh", "normal"),
                                   ("done", "normal")]
        }
        mark_published(session, job_ids=[jobs["fresh"].id, jobs["done"].id])
        jobs["stale"].queued_at = utcnow() - timedelta(seconds=120)
        jobs["never"].created_at = utcnow() - timedelta(seconds=120)
        complete_job(session, job_id=jobs["done"].id, result={"x": 1}, prompt_tokens=1,
                     completion_tokens=1, cached_tokens=0, first_token_at=None)
        ids = {name: job.id for name, job in jobs.items()}
        session.commit()

    producer = make_producer(s)
    try:
        reconciler = Reconciler(s, sessions, producer)
        assert reconciler.republish_stale() == 2
        assert reconciler.republish_stale() == 0, "restamped jobs are no longer stale"
    finally:
        producer.close()

    messages = _consume_all(s, expected=2)
    assert sorted(m.job_id for m in messages) == sorted([ids["stale"], ids["never"]])
    by_id = {m.job_id: m for m in messages}
    assert by_id[ids["stale"]].priority == "high"
    assert by_id[ids["never"]].body == body
    with sessions() as session:
        job = get_job(session, job_id=ids["never"])
        assert job is not None and job.queued_at is not None
        assert utcnow() - job.queued_at < timedelta(seconds=30)
    engine.dispose()


def test_startup_pass_republishes_everything_queued(settings) -> None:
    """With older_than=now (start-up), even just-published queued jobs go out again."""
    s = settings()
    engine = create_db_engine(s.database_url)
    Base.metadata.create_all(engine)
    sessions = session_factory(engine)
    ensure_topics(s)
    with sessions() as session:
        tenant = create_tenant(session, name="acme")
        job_ids = [
            create_job(session, tenant_id=tenant.id, priority="normal", model=s.model,
                       kind="text_completion", request={"prompt": f"p{i}"}).id
            for i in range(5)
        ]
        mark_published(session, job_ids=job_ids)
        session.commit()
    producer = make_producer(s)
    try:
        assert Reconciler(s, sessions, producer).republish_stale(older_than=utcnow()) == 5
    finally:
        producer.close()
    assert sorted(m.job_id for m in _consume_all(s, expected=5)) == sorted(job_ids)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs WHERE status='queued'")
                            ).scalar_one() == 5
    engine.dispose()


def _setup(s: Settings) -> tuple[sa.Engine, Any]:
    engine = create_db_engine(s.database_url)
    Base.metadata.create_all(engine)
    ensure_topics(s)
    return engine, session_factory(engine)


def test_a_poison_row_is_failed_and_the_rows_behind_it_still_go_out(
    settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unencodable rows at the head of the queue fail with a reason; newer ones are not starved.

    Pages of two, with both poison rows oldest: before, the first page failed on every
    pass and nothing behind it was ever re-published.
    """
    monkeypatch.setattr(reconciler_module, "PAGE_SIZE", 2)
    s = settings(requeue_after_s=60)
    engine, sessions = _setup(s)
    old = utcnow() - timedelta(seconds=600)
    with sessions() as session:
        tenant = create_tenant(session, name="acme")
        poison = [
            create_job(session, tenant_id=tenant.id, priority="normal", model=s.model,
                       kind="text_completion", request={"prompt": "x\ud800y"}),
            create_job(session, tenant_id=tenant.id, priority="high", model=s.model,
                       kind="chat.completion",
                       request={"messages": [{"role": "user", "content": "x\ud800y"}]}),
        ]
        good = [
            create_job(session, tenant_id=tenant.id, priority="low", model=s.model,
                       kind="text_completion", request={"prompt": f"fine {i}"})
            for i in range(3)
        ]
        for age, job in enumerate(poison + good):
            job.created_at = old + timedelta(seconds=age)  # poison first, oldest first
        poison_ids, good_ids = [j.id for j in poison], [j.id for j in good]
        session.commit()

    producer = make_producer(s)
    try:
        reconciler = Reconciler(s, sessions, producer)
        assert reconciler.republish_stale() == 3
        assert reconciler.republish_stale() == 0
    finally:
        producer.close()
    assert sorted(m.job_id for m in _consume_all(s, expected=3)) == sorted(good_ids)
    with sessions() as session:
        for job_id in poison_ids:
            row = get_job(session, job_id=job_id)
            assert row is not None and row.status == JobStatus.FAILED
            assert row.error is not None and row.error["code"] == "unpublishable"
            assert "\\ud800" in row.error["message"]  # escaped, so it can be stored and shown
            row.error["message"].encode()
    engine.dispose()


def test_startup_pass_survives_a_poison_row(settings) -> None:
    """`republish_stale(older_than=now)` (what `batchinfer up` runs first) fails it and goes on."""
    s = settings()
    engine, sessions = _setup(s)
    with sessions() as session:
        tenant = create_tenant(session, name="acme")
        bad = create_job(session, tenant_id=tenant.id, priority="normal", model=s.model,
                         kind="text_completion", request={"prompt": "x\ud800y"})
        fine = create_job(session, tenant_id=tenant.id, priority="normal", model=s.model,
                          kind="text_completion", request={"prompt": "fine"})
        mark_published(session, job_ids=[bad.id, fine.id])
        ids = (bad.id, fine.id)
        session.commit()
    producer = make_producer(s)
    try:
        assert Reconciler(s, sessions, producer).republish_stale(older_than=utcnow()) == 1
    finally:
        producer.close()
    assert [m.job_id for m in _consume_all(s, expected=1)] == [ids[1]]
    with sessions() as session:
        assert get_job(session, job_id=ids[0]).status == JobStatus.FAILED  # type: ignore[union-attr]
    engine.dispose()


def test_running_jobs_of_dead_workers_are_requeued_or_failed_after_the_last_attempt(
    settings,
) -> None:
    """Orphans go back to queued and out to Kafka at once; spent ones fail; live ones stay."""
    s = settings(worker_heartbeat_interval_s=1, worker_heartbeat_timeout_s=10, job_max_attempts=2)
    engine, sessions = _setup(s)
    with sessions() as session:
        tenant = create_tenant(session, name="acme")
        record_heartbeat(session, worker_id="alive")
        record_heartbeat(session, worker_id="dead", now=utcnow() - timedelta(seconds=60))
        jobs = {
            name: create_job(session, tenant_id=tenant.id, priority="normal", model=s.model,
                             kind="text_completion", request={"prompt": name})
            for name in ("of-dead", "of-gone", "spent", "of-alive")
        }
        mark_published(session, job_ids=[j.id for j in jobs.values()])  # not stale queued
        mark_running(session, job_id=jobs["of-dead"].id, worker_id="dead")
        mark_running(session, job_id=jobs["of-gone"].id, worker_id="left-without-a-trace")
        for _ in range(2):
            mark_running(session, job_id=jobs["spent"].id, worker_id="dead")
        mark_running(session, job_id=jobs["of-alive"].id, worker_id="alive")
        ids = {name: job.id for name, job in jobs.items()}
        session.commit()
    failed_before = REGISTRY.get_sample_value("batchinfer_jobs_reclaimed_total",
                                              {"outcome": "failed"}) or 0.0

    producer = make_producer(s)
    try:
        reconciler = Reconciler(s, sessions, producer)
        assert reconciler.republish_stale() == 2
        assert reconciler.republish_stale() == 0
    finally:
        producer.close()
    messages = {m.job_id: m for m in _consume_all(s, expected=2)}
    assert set(messages) == {ids["of-dead"], ids["of-gone"]}
    assert messages[ids["of-dead"]].attempt == 2
    with sessions() as session:
        rows = {name: get_job(session, job_id=job_id) for name, job_id in ids.items()}
        assert rows["of-dead"].status == JobStatus.QUEUED  # type: ignore[union-attr]
        assert rows["of-gone"].queued_at > utcnow() - timedelta(seconds=30)  # type: ignore[union-attr,operator]
        spent = rows["spent"]
        assert spent is not None and spent.status == JobStatus.FAILED
        assert spent.error is not None and spent.error["code"] == "worker_lost"
        assert rows["of-alive"].status == JobStatus.RUNNING  # type: ignore[union-attr]
        # The dead worker's row is pruned; the live one stays.
        assert live_worker_ids(session, dead_before=utcnow() - timedelta(days=1)) == ["alive"]
    assert REGISTRY.get_sample_value("batchinfer_jobs_reclaimed_total",
                                     {"outcome": "failed"}) == failed_before + 1
    engine.dispose()


def test_jobs_past_their_deadline_expire_and_running_ones_are_aborted(
    settings, redis_client
) -> None:
    """Queued and running jobs past their deadline become `expired`; a batch's jobs are
    left to their batch's window; a result stored later for an expired job is refused."""
    s = settings()
    engine = create_db_engine(s.database_url)
    Base.metadata.create_all(engine)
    sessions = session_factory(engine)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    past, future = utcnow() - timedelta(seconds=5), utcnow() + timedelta(hours=1)
    with sessions() as session:
        tenant = create_tenant(session, name="acme")

        def job(deadline: Any, **extra: Any) -> str:
            return create_job(session, tenant_id=tenant.id, priority="normal", model=s.model,
                              kind="chat.completion", request=body, deadline=deadline,
                              **extra).id

        ids = {"queued": job(past), "running": job(past), "later": job(future),
               "none": job(None), "batch": job(past, batch_id="batch_x")}
        mark_running(session, job_id=ids["running"], worker_id="w1")
        session.commit()

    cancels = redis_client.pubsub()
    cancels.subscribe(cancel_channel(s.topic_prefix))
    assert cancels.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
    reconciler = Reconciler(s, sessions, make_producer(s), redis_client=redis_client)
    try:
        assert reconciler.expire_past_deadline() == 2
        assert reconciler.expire_past_deadline() == 0
    finally:
        reconciler.producer.close()
    with sessions() as session:
        status = {name: session.get(Job, i).status for name, i in ids.items()}  # type: ignore[union-attr]
        expired = get_job(session, job_id=ids["queued"])
        assert expired is not None and expired.error is not None
        assert expired.error["code"] == "deadline_exceeded" and expired.finished_at is not None
        assert not complete_job(session, job_id=ids["running"], result={"x": 1},
                                prompt_tokens=1, completion_tokens=1, cached_tokens=0,
                                first_token_at=None)
    assert status == {"queued": JobStatus.EXPIRED, "running": JobStatus.EXPIRED,
                      "later": JobStatus.QUEUED, "none": JobStatus.QUEUED,
                      "batch": JobStatus.QUEUED}
    message = cancels.get_message(timeout=5)
    assert message is not None and ids["running"] in message["data"].decode()
