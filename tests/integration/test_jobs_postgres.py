"""Job and tenant queries on a migrated PostgreSQL: the production database behaves as SQLite."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from core.messages import JobMessage
from storage.db import create_db_engine, session_factory
from storage.job_messages import job_message
from storage.jobs import (
    IdempotencyKeyTaken,
    cancel_job,
    complete_job,
    count_active_jobs,
    create_job,
    find_by_idempotency_key,
    get_job,
    list_jobs,
    mark_running,
    stale_queued_jobs,
)
from storage.migrate import upgrade
from storage.models import Job, JobStatus, Tenant
from storage.tenants import create_api_key, tenant_for_api_key
from storage.webhooks import Delivery
from tests.unit.storage.test_executemany import check_many_statement_stores_what_sqlalchemy_stores
from tests.unit.storage.test_job_batches import check_complete_jobs
from tests.utils.api import committed_tenant
from workers.inference.job_store import JobStore, Success

# Seconds the racers wait for each other at the start line: far above a loaded start.
BARRIER_TIMEOUT_S = 60.0


@pytest.fixture
def sessions(postgres_url: str) -> Iterator[sessionmaker[Session]]:
    """Sessions on a fresh database migrated to head."""
    upgrade(postgres_url)
    engine = create_db_engine(postgres_url)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


@pytest.fixture
def tenant(sessions: sessionmaker[Session]) -> Tenant:
    """A committed tenant."""
    return committed_tenant(sessions)


def new_job(session: Session, tenant_id: str, idempotency_key: str | None = None) -> Job:
    """A queued chat job."""
    return create_job(
        session,
        tenant_id=tenant_id,
        priority="normal",
        model="m",
        kind="chat.completion",
        request={"messages": [{"role": "user", "content": "hi"}]},
        idempotency_key=idempotency_key,
    )


def test_keys_and_tenants(sessions: sessionmaker[Session], tenant: Tenant) -> None:
    with sessions() as session:
        _, key = create_api_key(session, tenant_id=tenant.id)
        session.commit()
        found = tenant_for_api_key(session, key=key)
        assert found is not None and found.id == tenant.id


def test_idempotency_race_is_reported_as_a_domain_error(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    with sessions() as first, sessions() as second:
        winner = new_job(first, tenant.id, idempotency_key="k")
        first.commit()
        with pytest.raises(IdempotencyKeyTaken):
            new_job(second, tenant.id, idempotency_key="k")
        second.rollback()
        found = find_by_idempotency_key(second, tenant_id=tenant.id, key="k")
        assert found is not None and found.id == winner.id


def test_datetimes_are_aware_utc_and_pages_are_stable(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    with sessions() as session:
        job_ids = [new_job(session, tenant.id).id for _ in range(5)]
        session.commit()
        same_instant = datetime(2025, 6, 1, 12, tzinfo=UTC)
        session.execute(update(Job).where(Job.id.in_(job_ids)).values(created_at=same_instant))
        session.commit()
        job = get_job(session, job_id=job_ids[0])
        assert job is not None and job.created_at == same_instant
        assert job.created_at.utcoffset() == timedelta(0)

        seen: list[str] = []
        after = None
        while True:
            page, has_more = list_jobs(session, tenant_id=tenant.id, limit=2, after=after)
            seen += [j.id for j in page]
            if not has_more:
                break
            after = page[-1].id
        assert seen == sorted(job_ids, reverse=True)


def test_status_writes_are_idempotent_under_concurrency(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    with sessions() as session:
        job_id = new_job(session, tenant.id).id
        session.commit()
        assert mark_running(session, job_id=job_id, worker_id="w")
        session.commit()
    start = threading.Barrier(6)
    changed: list[bool] = []

    def finish(i: int) -> None:
        with sessions() as session:
            start.wait(BARRIER_TIMEOUT_S)  # a thread that died first breaks it
            changed.append(
                complete_job(
                    session,
                    job_id=job_id,
                    result={"i": i},
                    prompt_tokens=1,
                    completion_tokens=2,
                    cached_tokens=0,
                    first_token_at=datetime.now(UTC),
                )
            )
            session.commit()

    threads = [threading.Thread(target=finish, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * BARRIER_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a racer hung"
    assert sorted(changed) == [False] * 5 + [True]
    with sessions() as session:
        job = cancel_job(session, job_id=job_id, tenant_id=tenant.id)
        session.commit()
        assert job is not None and job.status is JobStatus.SUCCEEDED
        assert job.started_at is not None and job.finished_at is not None
        assert job.started_at <= job.finished_at
        assert count_active_jobs(session, tenant_id=tenant.id) == 0


def test_complete_from_queued_and_stale_selection(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    with sessions() as session:
        cached, stale = new_job(session, tenant.id), new_job(session, tenant.id)
        session.commit()
        assert complete_job(
            session,
            job_id=cached.id,
            result={},
            prompt_tokens=0,
            completion_tokens=0,
            cached_tokens=0,
            first_token_at=None,
        )
        session.commit()
        job = get_job(session, job_id=cached.id)
        assert job is not None and job.started_at is not None
        later = datetime.now(UTC) + timedelta(seconds=1)
        assert [j.id for j in stale_queued_jobs(session, older_than=later, limit=10)] == [stale.id]


def test_complete_jobs_in_one_statement(sessions: sessionmaker[Session], tenant: Tenant) -> None:
    """What tests/unit/storage/test_job_batches.py checks on SQLite, on PostgreSQL."""
    check_complete_jobs(sessions, tenant)


def test_a_step_with_a_cancelled_job_stores_the_others(
    sessions: sessionmaker[Session], tenant: Tenant, redis_url: str
) -> None:
    """The worker's result write for a step: when one job was cancelled meanwhile, the
    one-statement write is rolled back and the others are stored one by one; only they are
    reported finished (cached, announced)."""
    with sessions() as session:
        created = [new_job(session, tenant.id) for _ in range(4)]
        session.commit()
        messages = [job_message(job) for job in created]
        assert cancel_job(session, job_id=created[2].id, tenant_id=tenant.id) is not None
        session.commit()
    store = JobStore(sessions, redis.Redis.from_url(redis_url), prefix="t-steps",
                     result_cache_ttl_s=0)
    results = [Success(m, {"choices": [{"text": m.job_id}], "usage": {"prompt_tokens": 2}},
                       None) for m in messages]
    expected = {m.job_id for i, m in enumerate(messages) if i != 2}
    assert store.succeed_many(results) == expected
    with sessions() as session:
        for i, message in enumerate(messages):
            job = get_job(session, job_id=message.job_id)
            assert job is not None
            if i == 2:
                assert job.status is JobStatus.CANCELLED and job.result is None
            else:
                assert job.status is JobStatus.SUCCEEDED and job.prompt_tokens == 2
                assert job.result == {"choices": [{"text": message.job_id}],
                                      "usage": {"prompt_tokens": 2}}
    assert store.succeed_many(results) == set()


def test_a_step_calls_back_the_jobs_whose_messages_may_have_a_callback(
    sessions: sessionmaker[Session], tenant: Tenant, redis_url: str
) -> None:
    """A job's message says whether it has a webhook: the worker's result write enqueues a
    delivery for a job with one, none for a job without (it does not look), and for a
    message from before the field (None) it looks the row up as it always did."""
    with sessions() as session:
        hooked, plain, older = (
            create_job(session, tenant_id=tenant.id, priority="normal", model="m",
                       kind="chat.completion", request={"messages": []},
                       callback_url=url)
            for url in ("https://example.com/a", None, "https://example.com/c"))
        session.commit()
        messages = [job_message(job) for job in (hooked, plain, older)]
    assert [m.has_callback for m in messages] == [True, False, True]
    messages[2] = messages[2].model_copy(update={"has_callback": None})
    assert JobMessage.decode(messages[1].encode()).has_callback is False
    store = JobStore(sessions, redis.Redis.from_url(redis_url), prefix="t-hooks",
                     result_cache_ttl_s=0)
    results = [Success(m, {"choices": [], "usage": {}}, None) for m in messages]
    assert store.succeed_many(results) == {m.job_id for m in messages}
    with sessions() as session:
        called = set(session.scalars(select(Delivery.job_id)))
    assert called == {hooked.id, older.id}


def test_a_jobs_cache_key_is_computed_once_from_look_up_to_fill(
    sessions: sessionmaker[Session], tenant: Tenant, redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker looks a deterministic job up in the result cache before running it and
    fills the cache after: the key is computed once for both, the fill lands where a
    later look-up finds it, and a failed job's remembered key is dropped."""
    import workers.inference.job_store as job_store_module

    computed: list[str] = []
    real_key = job_store_module.result_cache_key

    def counting_key(model: str, body: dict[str, object], *, salt: str | None = None) -> str | None:
        computed.append(str(body))
        return real_key(model, body, salt=salt)

    monkeypatch.setattr(job_store_module, "result_cache_key", counting_key)
    with sessions() as session:
        created = [create_job(session, tenant_id=tenant.id, priority="normal", model="m",
                              kind="text_completion", request={"prompt": f"p{i}",
                                                               "temperature": 0})
                   for i in range(3)]
        session.commit()
        messages = [job_message(job) for job in created]
    prefix = f"t-keys-{created[0].id}"
    store = JobStore(sessions, redis.Redis.from_url(redis_url), prefix=prefix,
                     result_cache_ttl_s=60)
    assert store.cached_results(messages) == [None, None, None]
    assert len(computed) == 3
    results = {m.job_id: {"choices": [{"text": m.job_id}], "usage": {}} for m in messages}
    assert store.succeed_many([Success(m, results[m.job_id], None)
                               for m in messages[:2]]) == {m.job_id for m in messages[:2]}
    assert store.fail(messages[2], error={"message": "refused"})
    assert len(computed) == 3 and not store._cache_keys
    later = JobStore(sessions, redis.Redis.from_url(redis_url), prefix=prefix,
                     result_cache_ttl_s=60)
    assert later.cached_results(messages) == [results[messages[0].job_id],
                                              results[messages[1].job_id], None]


def test_many_statement_stores_what_sqlalchemy_stores(
    sessions: sessionmaker[Session], tenant: Tenant
) -> None:
    """What tests/unit/storage/test_executemany.py checks on SQLite, on PostgreSQL."""
    check_many_statement_stores_what_sqlalchemy_stores(sessions, tenant)
