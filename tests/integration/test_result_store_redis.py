"""What the worker's store of finished jobs writes to a real Redis, and in how many trips.

Checked: after the database commit, one round trip carries the result-cache entries and
their ledger, the completion announcement and the token budgets' settling (counted at
the connection, confirmed by the server's own command counts); what lands is the cached
results with their TTL, the ledger's bytes, one announcement naming every finished job,
and each reservation replaced by the tokens used. One writer's error reply leaves the
others' writes done, and an unreachable Redis loses nothing in the database.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy
from prometheus_client import REGISTRY
from sqlalchemy.orm import Session, sessionmaker

from core.messages import JobMessage
from scheduler.embedded_services import free_port
from storage.db import create_db_engine, session_factory
from storage.events import jobs_done_channel
from storage.job_messages import job_message
from storage.jobs import create_job, get_job
from storage.models import Base, JobStatus, Tenant
from storage.result_cache import ResultCache
from storage.tenant_limits import ALL_MODELS, Budget
from storage.token_budget import TokenBudgets
from tests.utils.api import committed_tenant
from workers.inference.job_store import JobStore, Success

DAY = Budget(ALL_MODELS, 86_400, 1_000_000)
ESTIMATE = 50
CACHE_TTL_S = 600


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """Sessions on a fresh SQLite file with every table."""
    engine: sqlalchemy.Engine = create_db_engine(f"sqlite:///{tmp_path / 'jobs.db'}")
    Base.metadata.create_all(engine)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


@pytest.fixture
def tenant(sessions: sessionmaker[Session]) -> Tenant:
    """A committed tenant."""
    return committed_tenant(sessions)


class _Trips:
    """Round trips of one client: each is one write of packed commands to the socket (a
    pipeline is one), each followed by reading its replies."""

    def __init__(self, url: str) -> None:
        self.count = 0
        trips = self

        class CountingConnection(redis.Connection):
            def send_packed_command(self, command: Any, check_health: bool = True) -> None:
                trips.count += 1
                super().send_packed_command(command, check_health)

        self.client = redis.Redis(connection_pool=redis.ConnectionPool.from_url(
            url, connection_class=CountingConnection))


def _messages(sessions: sessionmaker[Session], tenant: Tenant,
              bodies: list[dict[str, Any]]) -> list[JobMessage]:
    with sessions() as session:
        created = [create_job(session, tenant_id=tenant.id, priority="normal", model="m",
                              kind="text_completion", request=body) for body in bodies]
        session.commit()
        return [job_message(job) for job in created]


def _result(message: JobMessage, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": f"cmpl-{message.job_id}", "choices": [{"text": message.job_id}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _command_calls(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
            for name in ("set", "publish", "evalsha", "eval")}


def _announcements(pubsub: redis.client.PubSub) -> list[dict[str, Any]]:
    """The announcement messages received so far (waiting up to 5 s for the first)."""
    heard: list[dict[str, Any]] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if message is None and heard:
            break
        if message is not None:
            heard.append(json.loads(message["data"]))
    return heard


def _subscribed(client: redis.Redis, channel: str) -> redis.client.PubSub:
    pubsub = client.pubsub()
    pubsub.subscribe(channel)
    confirmation = pubsub.get_message(timeout=5)
    assert confirmation is not None and confirmation["type"] == "subscribe"
    return pubsub


def _counted_store(sessions: sessionmaker[Session], redis_url: str, redis_client: redis.Redis,
                   name: str) -> tuple[str, _Trips, JobStore, TokenBudgets]:
    """A store under a fresh prefix whose Redis round trips are counted, and the budgets."""
    prefix = f"t-{name}-{uuid.uuid4().hex[:8]}"
    trips = _Trips(redis_url)
    store = JobStore(sessions, trips.client, prefix=prefix, result_cache_ttl_s=CACHE_TTL_S)
    return prefix, trips, store, TokenBudgets(redis_client, prefix=prefix)


def test_a_steps_results_reach_redis_in_one_round_trip(
        sessions: sessionmaker[Session], tenant: Tenant, redis_url: str,
        redis_client: redis.Redis) -> None:
    prefix, trips, store, budgets = _counted_store(sessions, redis_url, redis_client, "store")
    # Three deterministic jobs (cached) and one sampled one (never cached), after a first
    # store that loads the scripts and opens the connection.
    first, *step = _messages(sessions, tenant, [
        {"prompt": "warm", "temperature": 0},
        *({"prompt": f"p{i}", "temperature": 0} for i in range(3)),
        {"prompt": "sampled", "temperature": 1}])
    granted = budgets.reserve(tenant_id=tenant.id, budgets=[DAY],
                              jobs=[(m.job_id, ESTIMATE) for m in (first, *step)])
    assert granted.num_granted == 5
    assert store.succeed_many([Success(first, _result(first, 3, 1), None)]) == {first.job_id}
    assert budgets.used(tenant_id=tenant.id, budget=DAY, at=time.time()) == 4 + 4 * ESTIMATE

    pubsub = _subscribed(redis_client, jobs_done_channel(prefix))
    results = {m.job_id: _result(m, 5 + i, 1) for i, m in enumerate(step)}
    calls_before = _command_calls(redis_client)
    trips.count = 0
    stored = store.succeed_many([Success(m, results[m.job_id], None) for m in step])
    num_trips = trips.count
    calls = {name: n - calls_before[name] for name, n in _command_calls(redis_client).items()}

    assert stored == {m.job_id for m in step}
    assert num_trips == 1
    # Three entries, the ledger's script, the budgets' script, one announcement.
    assert calls == {"set": 3, "publish": 1, "evalsha": 2, "eval": 0}
    # The cache: what a later look-up finds, for as long as asked.
    cache = ResultCache(redis_client, prefix=prefix)
    later = JobStore(sessions, redis_client, prefix=prefix, result_cache_ttl_s=CACHE_TTL_S)
    assert later.cached_results(step) == [results[m.job_id] for m in step[:3]] + [None]
    held = list(redis_client.scan_iter(f"{prefix}:result:*"))
    assert len(held) == 4  # the first job's and the step's three
    assert all(0 < redis_client.ttl(key) <= CACHE_TTL_S for key in held)
    assert cache.ledger.sweep().resident_bytes == sum(
        len(redis_client.get(key) or b"") for key in held)
    # The announcement: one message naming every finished job.
    assert _announcements(pubsub) == [
        {"jobs": dict.fromkeys((m.job_id for m in step), JobStatus.SUCCEEDED.value)}]
    pubsub.close()
    # The budget: each estimate replaced by the tokens used, each reservation gone.
    used = 4 + sum(5 + i + 1 for i in range(4))
    assert budgets.used(tenant_id=tenant.id, budget=DAY, at=time.time()) == used
    assert budgets.settle([(m.job_id, 0) for m in (first, *step)]) == 0


def test_a_failed_job_is_announced_and_settled_in_one_round_trip(
        sessions: sessionmaker[Session], tenant: Tenant, redis_url: str,
        redis_client: redis.Redis) -> None:
    prefix, trips, store, budgets = _counted_store(sessions, redis_url, redis_client, "fail")
    warm, message = _messages(sessions, tenant, [{"prompt": "a"}, {"prompt": "b"}])
    budgets.reserve(tenant_id=tenant.id, budgets=[DAY],
                    jobs=[(warm.job_id, ESTIMATE), (message.job_id, ESTIMATE)])
    assert store.fail(warm, error={"message": "refused"})
    pubsub = _subscribed(redis_client, f"{prefix}:jobs:done:{message.job_id}")
    trips.count = 0
    assert store.fail(message, error={"message": "refused"})
    assert trips.count == 1
    assert _announcements(pubsub) == [{"job_id": message.job_id, "status": "failed"}]
    pubsub.close()
    assert budgets.used(tenant_id=tenant.id, budget=DAY, at=time.time()) == 0
    assert not store.fail(message, error={"message": "again"})  # finished once only


def test_a_cache_write_error_leaves_the_announcement_and_settling_done(
        sessions: sessionmaker[Session], tenant: Tenant, redis_client: redis.Redis) -> None:
    """The ledger's totals under a key of the wrong type: the cache write fails (counted),
    and the announcement and settling, sent with it, still happen, as separate calls did."""
    prefix = f"t-iso-{uuid.uuid4().hex[:8]}"
    store = JobStore(sessions, redis_client, prefix=prefix, result_cache_ttl_s=CACHE_TTL_S)
    budgets = TokenBudgets(redis_client, prefix=prefix)
    (message,) = _messages(sessions, tenant, [{"prompt": "x", "temperature": 0}])
    budgets.reserve(tenant_id=tenant.id, budgets=[DAY], jobs=[(message.job_id, ESTIMATE)])
    totals_key = ResultCache(redis_client, prefix=prefix).ledger.keys[3]
    redis_client.rpush(totals_key, "not a hash")
    errors_before = REGISTRY.get_sample_value("batchinfer_cache_errors_total",
                                              {"kind": "exact"}) or 0.0
    pubsub = _subscribed(redis_client, jobs_done_channel(prefix))
    assert store.succeed_many([Success(message, _result(message, 7, 1), None)]) \
        == {message.job_id}
    assert REGISTRY.get_sample_value("batchinfer_cache_errors_total",
                                     {"kind": "exact"}) == errors_before + 1
    assert _announcements(pubsub) == [{"jobs": {message.job_id: "succeeded"}}]
    pubsub.close()
    assert budgets.used(tenant_id=tenant.id, budget=DAY, at=time.time()) == 8


def test_an_unreachable_redis_loses_no_stored_result(
        sessions: sessionmaker[Session], tenant: Tenant) -> None:
    nowhere = redis.Redis(port=free_port(), socket_connect_timeout=1)
    store = JobStore(sessions, nowhere, prefix="t-gone", result_cache_ttl_s=CACHE_TTL_S)
    done, failed = _messages(sessions, tenant, [{"prompt": "x", "temperature": 0},
                                                {"prompt": "y"}])
    assert store.succeed_many([Success(done, _result(done, 2, 1), None)]) == {done.job_id}
    assert store.fail(failed, error={"message": "refused"})
    with sessions() as session:
        rows = [get_job(session, job_id=m.job_id) for m in (done, failed)]
    assert [row.status if row else None for row in rows] == [JobStatus.SUCCEEDED,
                                                               JobStatus.FAILED]
