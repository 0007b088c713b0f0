"""The reconciler re-publishes stale queued jobs through the real broker and PostgreSQL."""

from __future__ import annotations

import time
from datetime import timedelta

import sqlalchemy as sa
from kafka import TopicPartition

from core.kafka import ensure_topics, make_consumer, make_producer
from core.messages import JobMessage
from core.settings import Settings
from scheduler.reconciler import Reconciler
from storage.db import create_db_engine, session_factory
from storage.jobs import complete_job, create_job, get_job, mark_published
from storage.models import Base, utcnow
from storage.tenants import create_tenant


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
