"""429s: the per-tenant token bucket and the active-job cap. Refused requests write nothing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis
from sqlalchemy.orm import Session, sessionmaker

from api.rate_limit import TokenBucketLimiter
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.utils.api import CHAT_BODY, TenantKey, count_jobs

VALID: dict[str, Any] = {"model": MODEL, **CHAT_BODY}


def test_bucket_admits_a_burst_then_refuses_then_refills(redis_url: str) -> None:
    """rate=2/s: two at once pass, the third waits up to 0.5 s, and later passes. (The
    burst must be taken within one token's refill: 0.5 s leaves a loaded machine room.)"""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        limiter = TokenBucketLimiter(client, prefix="rl-test-1", rate_per_s=2)
        assert [await limiter.retry_after_s("t") for _ in range(2)] == [None] * 2
        wait = await limiter.retry_after_s("t")
        assert wait is not None and 0 < wait <= 0.5 + 1e-6
        assert await limiter.retry_after_s("other-tenant") is None
        await asyncio.sleep(wait + 0.05)
        assert await limiter.retry_after_s("t") is None
        await client.aclose()

    asyncio.run(scenario())


def test_concurrent_submissions_share_calls_and_never_exceed_the_bucket(redis_url: str) -> None:
    """rate=5/s, 40 at once: exactly 5 admitted, in arrival order, in far fewer script calls;
    a waiter whose request went away does not hold up the others."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        limiter = TokenBucketLimiter(client, prefix="rl-test-2", rate_per_s=5)
        script = limiter._script
        calls: list[int] = []

        async def counted(*, keys: list[str], args: list[Any]) -> Any:
            calls.append(args[2])
            return await script(keys=keys, args=args)

        limiter._script = counted  # type: ignore[assignment]
        tasks = [asyncio.ensure_future(limiter.retry_after_s("t")) for _ in range(40)]
        await asyncio.sleep(0)  # all 40 arrived: the first one's call is in flight
        tasks[1].cancel()  # its client went away while it waited
        verdicts = await asyncio.gather(*(tasks[:1] + tasks[2:]))
        # Arrival order: the first, the cancelled second (its token is spent), then three.
        assert verdicts[:4] == [None] * 4
        assert all(v is not None and 0 < v <= 0.2 + 1e-6 for v in verdicts[4:])
        assert sum(calls) == 40 and len(calls) <= 3, calls
        assert limiter._waiting == {} and not limiter._tasks
        assert await limiter.retry_after_s("other-tenant") is None
        await client.aclose()

    asyncio.run(scenario())


def test_a_failed_shared_call_fails_its_waiters_and_the_next_call_starts_afresh(
    redis_url: str,
) -> None:
    """An unexpected error in a shared call reaches every request of it; none hangs, and
    the tenant's next submission is served normally."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        limiter = TokenBucketLimiter(client, prefix="rl-test-3", rate_per_s=100)
        script = limiter._script
        calls = 0

        async def second_call_fails(*, keys: list[str], args: list[Any]) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise ValueError("boom")
            return await script(keys=keys, args=args)

        limiter._script = second_call_fails  # type: ignore[assignment]
        results = await asyncio.wait_for(asyncio.gather(
            *(limiter.retry_after_s("t") for _ in range(5)), return_exceptions=True), 5)
        assert results[0] is None
        assert all(isinstance(r, ValueError) for r in results[1:]), results
        assert limiter._waiting == {}
        assert await asyncio.wait_for(limiter.retry_after_s("t"), 5) is None
        await client.aclose()

    asyncio.run(scenario())


def test_without_redis_submissions_are_admitted_and_long_polls_poll(
    make_client: ClientFactory, acme: TenantKey
) -> None:
    """Redis down: the limiter fails open, long-poll falls back to the database, cancel works."""
    client = make_client(redis_url="redis://127.0.0.1:9/0", tenant_rate_limit_per_s=1)
    ids = [client.post("/v1/jobs", json=VALID, headers=acme.headers) for _ in range(3)]
    assert [r.status_code for r in ids] == [202, 202, 202]
    job_id = ids[0].json()["id"]
    started = time.monotonic()
    polled = client.get(f"/v1/jobs/{job_id}?wait=0.5", headers=acme.headers)
    assert polled.json()["status"] == "queued"
    assert time.monotonic() - started < 3.0
    cancelled = client.post(f"/v1/jobs/{job_id}/cancel", headers=acme.headers)
    assert cancelled.json()["status"] == "cancelled"


def test_over_rate_is_429_with_retry_after(
    make_client: ClientFactory, acme: TenantKey, globex: TenantKey,
    sessions: sessionmaker[Session],
) -> None:
    """One every two seconds: the second submission in a burst is refused; other tenants
    are not. (A bucket that refills in 2 s leaves a loaded machine time for the burst.)"""
    client = make_client(tenant_rate_limit_per_s=0.5)
    statuses = [client.post("/v1/jobs", json=VALID, headers=acme.headers).status_code
                for _ in range(2)]
    assert statuses == [202, 429]
    refused = client.post("/v1/jobs", json=VALID, headers=acme.headers)
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert client.post("/v1/jobs", json=VALID, headers=globex.headers).status_code == 202
    assert count_jobs(sessions) == 2


def test_active_job_cap_is_429_until_one_finishes(
    make_client: ClientFactory, acme: TenantKey, sessions: sessionmaker[Session]
) -> None:
    """At tenant_max_active_jobs queued or running, the next waits; a cancel frees a slot."""
    client = make_client(tenant_max_active_jobs=2)
    ids = [client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
           for _ in range(2)]
    refused = client.post("/v1/jobs", json=VALID, headers=acme.headers)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "too_many_active_jobs"
    assert "Retry-After" in refused.headers
    assert count_jobs(sessions) == 2
    client.post(f"/v1/jobs/{ids[0]}/cancel", headers=acme.headers)
    assert client.post("/v1/jobs", json=VALID, headers=acme.headers).status_code == 202
