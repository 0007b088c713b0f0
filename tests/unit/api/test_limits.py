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


# One token per ten minutes, longer than any test may run: a bucket at this rate refuses
# its second call however slowly the machine takes the calls.
SLOW_RATE_PER_S = 1 / 600


def test_bucket_admits_a_burst_then_refuses_then_refills(redis_url: str) -> None:
    """A full bucket admits its burst whatever the pace; an empty one refuses, says how
    long until its next token, and admits once that time has passed (the bucket's clock
    moved back by the wait, in Redis: no test waits ten minutes)."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        burst = TokenBucketLimiter(client, prefix="rl-test-1", rate_per_s=5)
        assert [await burst.retry_after_s("t") for _ in range(5)] == [None] * 5
        limiter = TokenBucketLimiter(client, prefix="rl-test-1b", rate_per_s=SLOW_RATE_PER_S)
        assert await limiter.retry_after_s("t") is None
        wait = await limiter.retry_after_s("t")
        assert wait is not None and 0 < wait <= 600 + 1e-6
        assert await limiter.retry_after_s("other-tenant") is None
        # As if the wait and one more second had passed (the second keeps the sum clear of
        # rounding: exactly `wait` could leave 0.999... tokens).
        await client.hincrbyfloat("rl-test-1b:ratelimit:t", "ts", -(wait + 1))
        assert await limiter.retry_after_s("t") is None
        assert await limiter.retry_after_s("t") is not None  # one token came back, not two
        await client.aclose()

    asyncio.run(scenario())


def test_concurrent_submissions_share_calls_and_never_exceed_the_bucket(redis_url: str) -> None:
    """rate=5/s, 40 at once: 5 admitted (and no more than refilled meanwhile: 5 per second
    the calls took), in arrival order, in far fewer script calls; a waiter whose request
    went away does not hold up the others."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        limiter = TokenBucketLimiter(client, prefix="rl-test-2", rate_per_s=5)
        script = limiter._script
        calls: list[int] = []

        async def counted(*, keys: list[str], args: list[Any]) -> Any:
            calls.append(args[2])
            return await script(keys=keys, args=args)

        limiter._script = counted  # type: ignore[assignment]
        started = time.monotonic()
        tasks = [asyncio.ensure_future(limiter.retry_after_s("t")) for _ in range(40)]
        await asyncio.sleep(0)  # all 40 arrived: the first one's call is in flight
        tasks[1].cancel()  # its client went away while it waited
        verdicts = await asyncio.gather(*(tasks[:1] + tasks[2:]))
        elapsed = time.monotonic() - started
        # Arrival order: the first, the cancelled second (its token is spent), then three;
        # on a slow machine, the tokens refilled while the calls ran go to those next.
        num_admitted = verdicts.count(None) + 1
        assert verdicts[: num_admitted - 1] == [None] * (num_admitted - 1)
        assert 5 <= num_admitted <= 5 + 5 * elapsed, (num_admitted, elapsed)
        refused = verdicts[num_admitted - 1:]
        assert all(v is not None and 0 < v <= 0.2 + 1e-6 for v in refused)
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
    """One every ten minutes: the second submission is refused however long the first
    took; other tenants are not."""
    client = make_client(tenant_rate_limit_per_s=SLOW_RATE_PER_S)
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
