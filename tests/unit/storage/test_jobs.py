"""Job queries: creation, idempotency keys, tenant isolation, pagination, staleness."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

import storage.jobs
from core.topics import Priority
from storage.jobs import (
    IdempotencyKeyTaken,
    cancel_job,
    complete_job,
    count_active_jobs,
    create_job,
    find_by_idempotency_key,
    get_job,
    job_view,
    job_views,
    list_jobs,
    mark_published,
    mark_running,
    stale_queued_jobs,
)
from storage.models import Job, JobStatus, Tenant

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def new_job(session: Session, tenant: Tenant, **overrides: object) -> Job:
    """A chat job for `tenant` with sensible defaults."""
    values: dict[str, object] = {
        "tenant_id": tenant.id,
        "priority": "normal",
        "model": "smollm2-135m-instruct",
        "kind": "chat.completion",
        "request": BODY,
    }
    values.update(overrides)
    return create_job(session, **values)  # type: ignore[arg-type]


def test_created_job_is_queued_with_everything_stored(session: Session, tenant: Tenant) -> None:
    job = new_job(
        session,
        tenant,
        priority=Priority.HIGH,
        callback_url="https://example.com/hook",
        metadata={"run": "a"},
        batch_id="batch_1",
        custom_id="row-1",
        cache_key="sys-prompt-1",
    )
    session.commit()
    assert re.fullmatch(r"job_[0-9a-f]{24}", job.id)
    with Session(session.get_bind()) as fresh:
        stored = get_job(fresh, job_id=job.id)
        assert stored is not None
        assert stored.status is JobStatus.QUEUED
        assert stored.priority == "high"
        assert stored.request == BODY
        assert stored.metadata_ == {"run": "a"}
        assert (stored.batch_id, stored.custom_id, stored.cache_key) == (
            "batch_1",
            "row-1",
            "sys-prompt-1",
        )
        assert stored.attempts == 0
        assert stored.created_at.tzinfo is not None
        assert abs(datetime.now(UTC) - stored.created_at) < timedelta(seconds=5)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("priority", "urgent", "priority 'urgent' is not one of high, normal, low"),
        ("kind", "image", "job kind 'image' is not one of"),
    ],
)
def test_bad_priority_or_kind_is_refused(
    session: Session, tenant: Tenant, field: str, value: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        new_job(session, tenant, **{field: value})


def test_idempotency_key_is_unique_per_tenant(
    sessions: sessionmaker[Session], tenant: Tenant, other_tenant: Tenant
) -> None:
    with sessions() as session:
        first = new_job(session, tenant, idempotency_key="k1", request_hash="h")
        # Another tenant may use the same key.
        theirs = new_job(session, other_tenant, idempotency_key="k1")
        session.commit()
    with sessions() as session:
        found = find_by_idempotency_key(session, tenant_id=tenant.id, key="k1")
        assert found is not None and found.id == first.id and found.request_hash == "h"
        found_theirs = find_by_idempotency_key(session, tenant_id=other_tenant.id, key="k1")
        assert found_theirs is not None and found_theirs.id == theirs.id
        assert find_by_idempotency_key(session, tenant_id=tenant.id, key="k2") is None
        with pytest.raises(IdempotencyKeyTaken, match="'k1' is already used"):
            new_job(session, tenant, idempotency_key="k1")
        session.rollback()
        assert find_by_idempotency_key(session, tenant_id=tenant.id, key="k1") is not None
        # Jobs without a key never collide.
        new_job(session, tenant)
        new_job(session, tenant)
        session.commit()


def test_get_job_hides_other_tenants_jobs(
    session: Session, tenant: Tenant, other_tenant: Tenant
) -> None:
    job = new_job(session, tenant)
    session.commit()
    assert get_job(session, job_id=job.id, tenant_id=tenant.id) is not None
    assert get_job(session, job_id=job.id, tenant_id=other_tenant.id) is None
    assert get_job(session, job_id=job.id) is not None
    assert get_job(session, job_id="job_missing") is None
    assert cancel_job(session, job_id=job.id, tenant_id=other_tenant.id) is None
    assert get_job(session, job_id=job.id, tenant_id=tenant.id).status is JobStatus.QUEUED  # type: ignore[union-attr]


def set_created_at(session: Session, job_ids: list[str], when: datetime) -> None:
    """Give jobs one shared creation time, as a burst within a clock tick would have."""
    session.execute(update(Job).where(Job.id.in_(job_ids)).values(created_at=when))
    session.commit()


def test_pagination_is_newest_first_and_stable_on_equal_timestamps(
    session: Session, tenant: Tenant, other_tenant: Tenant
) -> None:
    base = datetime(2025, 1, 1, tzinfo=UTC)
    older = [new_job(session, tenant).id for _ in range(3)]
    burst = [new_job(session, tenant).id for _ in range(5)]
    newest = new_job(session, tenant).id
    new_job(session, other_tenant)
    session.commit()
    for i, job_id in enumerate(older):
        set_created_at(session, [job_id], base + timedelta(seconds=i))
    set_created_at(session, burst, base + timedelta(seconds=10))
    set_created_at(session, [newest], base + timedelta(seconds=20))

    expected = [newest, *sorted(burst, reverse=True), *reversed(older)]
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        page, has_more = list_jobs(session, tenant_id=tenant.id, limit=2, after=after)
        seen.extend(job.id for job in page)
        pages += 1
        if not has_more:
            break
        after = page[-1].id
    assert seen == expected
    assert pages == 5

    everything, has_more = list_jobs(session, tenant_id=tenant.id, limit=100)
    assert [job.id for job in everything] == expected and not has_more


def test_list_filters_by_status_and_hides_other_tenants(
    session: Session, tenant: Tenant, other_tenant: Tenant
) -> None:
    queued = new_job(session, tenant)
    running = new_job(session, tenant)
    new_job(session, other_tenant)
    session.commit()
    assert mark_running(session, job_id=running.id, worker_id="w1")
    session.commit()
    page, _ = list_jobs(session, tenant_id=tenant.id, status=JobStatus.QUEUED)
    assert [job.id for job in page] == [queued.id]
    page, _ = list_jobs(session, tenant_id=tenant.id, status=JobStatus.RUNNING)
    assert [job.id for job in page] == [running.id]
    page, _ = list_jobs(session, tenant_id=other_tenant.id)
    assert len(page) == 1 and page[0].tenant_id == other_tenant.id


def test_list_refuses_bad_limits_and_foreign_cursors(
    session: Session, tenant: Tenant, other_tenant: Tenant
) -> None:
    theirs = new_job(session, other_tenant)
    session.commit()
    for limit in (0, 101):
        with pytest.raises(ValueError, match="limit must be between 1 and 100"):
            list_jobs(session, tenant_id=tenant.id, limit=limit)
    with pytest.raises(ValueError, match="unknown cursor"):
        list_jobs(session, tenant_id=tenant.id, after=theirs.id)


def test_stale_queued_selection(session: Session, tenant: Tenant) -> None:
    now = datetime.now(UTC)
    published_long_ago = new_job(session, tenant)
    published_recently = new_job(session, tenant)
    never_published_old = new_job(session, tenant)
    never_published_new = new_job(session, tenant)
    running_old = new_job(session, tenant)
    session.commit()
    mark_published(session, job_ids=[published_long_ago.id, published_recently.id, running_old.id])
    session.execute(
        update(Job)
        .where(Job.id.in_([published_long_ago.id, running_old.id]))
        .values(queued_at=now - timedelta(minutes=10))
    )
    session.commit()
    set_created_at(session, [never_published_old.id], now - timedelta(minutes=20))
    set_created_at(session, [published_long_ago.id], now - timedelta(minutes=15))
    assert mark_running(session, job_id=running_old.id, worker_id="w1")
    session.commit()

    stale = stale_queued_jobs(session, older_than=now - timedelta(minutes=5), limit=10)
    assert [job.id for job in stale] == [never_published_old.id, published_long_ago.id]
    assert never_published_new.id not in {job.id for job in stale}
    assert len(stale_queued_jobs(session, older_than=now - timedelta(minutes=5), limit=1)) == 1
    with pytest.raises(ValueError, match="limit must be at least 1"):
        stale_queued_jobs(session, older_than=now, limit=0)


def test_mark_published_stamps_only_queued_jobs(session: Session, tenant: Tenant) -> None:
    queued, running = new_job(session, tenant), new_job(session, tenant)
    session.commit()
    mark_running(session, job_id=running.id, worker_id="w")
    mark_published(session, job_ids=[queued.id, running.id])
    mark_published(session, job_ids=[])
    session.commit()
    assert queued.queued_at is not None
    assert running.queued_at is None


def test_count_active_jobs(session: Session, tenant: Tenant, other_tenant: Tenant) -> None:
    jobs = [new_job(session, tenant) for _ in range(4)]
    new_job(session, other_tenant)
    session.commit()
    mark_running(session, job_id=jobs[0].id, worker_id="w")
    complete_job(
        session,
        job_id=jobs[1].id,
        result={"x": 1},
        prompt_tokens=1,
        completion_tokens=1,
        cached_tokens=0,
        first_token_at=None,
    )
    cancel_job(session, job_id=jobs[2].id, tenant_id=tenant.id)
    session.commit()
    assert count_active_jobs(session, tenant_id=tenant.id) == 2
    assert count_active_jobs(session, tenant_id=other_tenant.id) == 1
    assert count_active_jobs(session, tenant_id="ten_none") == 0


def test_job_view_reads_the_tenants_job_only_and_leaves_its_request_out(
    session: Session, tenant: Tenant, other_tenant: Tenant
) -> None:
    """The long-poll's read: the public view's columns, None for a missing or foreign job."""
    job = create_job(session, tenant_id=tenant.id, priority=Priority.NORMAL, model="m",
                     kind="chat.completion", request=BODY, metadata={"k": "v"})
    session.commit()
    connection = session.connection()
    row = job_view(connection, job_id=job.id, tenant_id=tenant.id)
    assert row is not None and row.status is JobStatus.QUEUED and row.metadata_ == {"k": "v"}
    assert "request" not in row._fields
    assert job_view(connection, job_id=job.id, tenant_id=other_tenant.id) is None
    assert job_view(connection, job_id="job_missing", tenant_id=tenant.id) is None
    assert complete_job(session, job_id=job.id, result={"id": "r", "choices": []},
                        prompt_tokens=3, completion_tokens=1, cached_tokens=2,
                        first_token_at=None)
    session.commit()
    row = job_view(session.connection(), job_id=job.id, tenant_id=tenant.id)
    assert row is not None
    assert (row.status, row.result, row.prompt_tokens, row.completion_tokens,
            row.cached_tokens) == (JobStatus.SUCCEEDED, {"id": "r", "choices": []}, 3, 1, 2)
    assert row.finished_at is not None and row.finished_at.tzinfo is not None


def test_job_views_reads_many_jobs_in_chunks_with_their_tenants(
    session: Session, tenant: Tenant, other_tenant: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub's read for an announcement: every existing job's view by id, with the tenant
    each reader must match; missing ids are left out, and ids past a chunk's size are read
    by further queries, not dropped."""
    monkeypatch.setattr(storage.jobs, "MAX_VIEWS_PER_READ", 2)
    mine = [new_job(session, tenant, metadata={"n": str(i)}) for i in range(3)]
    theirs = new_job(session, other_tenant)
    session.commit()
    ids = [job.id for job in mine] + [theirs.id, "job_missing"]
    views = job_views(session.connection(), ids)
    assert set(views) == set(ids) - {"job_missing"}
    assert [views[job.id].metadata_ for job in mine] == [{"n": "0"}, {"n": "1"}, {"n": "2"}]
    assert {views[job.id].tenant_id for job in mine} == {tenant.id}
    assert views[theirs.id].tenant_id == other_tenant.id
    assert all(v.status is JobStatus.QUEUED and "request" not in v._fields
               for v in views.values())
    assert job_views(session.connection(), []) == {}


def test_new_jobs_inserted_together_read_back_as_created(session: Session,
                                                         tenant: Tenant) -> None:
    """`insert_new_jobs` writes every field `new_job_values` sets, and nothing else."""
    jobs = [
        storage.jobs.new_job(tenant_id=tenant.id, priority="high", model="m",
                             kind="chat.completion", request=BODY, published=True,
                             metadata={"n": n}, idempotency_key=f"k{n}", request_hash="h",
                             callback_url="https://example.com/hook", cache_key="c")
        for n in range(3)
    ]
    storage.jobs.insert_new_jobs(session, jobs)
    session.commit()
    assert set(storage.jobs.NEW_JOB_FIELDS) == set(storage.jobs.new_job_values(
        tenant_id=tenant.id, priority="low", model="m", kind="embedding", request={}))
    with Session(session.get_bind()) as fresh:
        for job in jobs:
            stored = fresh.get(Job, job.id)
            assert stored is not None
            assert {k: getattr(stored, k) for k in storage.jobs.NEW_JOB_FIELDS} == {
                k: getattr(job, k) for k in storage.jobs.NEW_JOB_FIELDS}
            assert stored.status is JobStatus.QUEUED and stored.result is None


def test_new_jobs_inserted_together_refuse_a_taken_idempotency_key(
        session: Session, tenant: Tenant) -> None:
    """A clash fails the whole statement, as a flush would, and stores none of it."""
    new_job(session, tenant, idempotency_key="taken")
    session.commit()
    jobs = [storage.jobs.new_job(tenant_id=tenant.id, priority="normal", model="m",
                                 kind="chat.completion", request=BODY, idempotency_key=key)
            for key in ("fresh", "taken")]
    with pytest.raises(IntegrityError):
        storage.jobs.insert_new_jobs(session, jobs)
    session.rollback()
    assert find_by_idempotency_key(session, tenant_id=tenant.id, key="fresh") is None
