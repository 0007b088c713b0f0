"""The API's one shared subscription to job completions, over a real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from storage.events import publish_job_done, publish_jobs_done
from storage.job_done_hub import JobDoneHub
from storage.models import JobStatus


@pytest.fixture
def prefix() -> str:
    """A channel prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A synchronous client, as workers publish with."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


async def listening(hub: JobDoneHub, within_s: float = 5.0) -> None:
    """Until the hub's subscription is confirmed."""
    deadline = time.monotonic() + within_s
    while not hub.is_listening:
        assert time.monotonic() < deadline, "the hub never started listening"
        await asyncio.sleep(0.01)


def test_registered_waiters_wake_on_their_own_job_only(
    redis_url: str, client: redis.Redis, prefix: str
) -> None:
    """Two waiters on one job and one on another: a completion wakes exactly the first
    two, with True; the third times out; a step's pipelined announcements wake it."""
    async def scenario() -> None:
        aredis = aioredis.Redis.from_url(redis_url)
        hub = JobDoneHub(aredis, prefix=prefix)
        hub.start()
        try:
            await listening(hub)
            first, second = hub.register("job_a"), hub.register("job_a")
            other = hub.register("job_b")
            started = time.monotonic()
            await asyncio.to_thread(publish_job_done, client, prefix=prefix, job_id="job_a",
                                    status=JobStatus.SUCCEEDED)
            assert await asyncio.wait_for(first, 5) and await asyncio.wait_for(second, 5)
            assert time.monotonic() - started < 2
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(other), 0.3)
            await asyncio.to_thread(publish_jobs_done, client, prefix=prefix,
                                    statuses={"job_c": JobStatus.FAILED,
                                              "job_b": JobStatus.SUCCEEDED})
            assert await asyncio.wait_for(other, 5)
            for job_id, future in (("job_a", first), ("job_a", second), ("job_b", other)):
                hub.unregister(job_id, future)
        finally:
            await hub.aclose()
            await aredis.aclose()

    asyncio.run(scenario())


def test_a_lost_subscription_wakes_waiters_with_false_and_comes_back(
    redis_url: str, client: redis.Redis, prefix: str
) -> None:
    """Redis drops the hub's connection: every waiter hears False (it cannot know what it
    missed), the hub stops claiming to listen, subscribes again, and wakes new waiters."""
    async def scenario() -> None:
        aredis = aioredis.Redis.from_url(redis_url)
        hub = JobDoneHub(aredis, prefix=prefix)
        hub.start()
        try:
            await listening(hub)
            waiting = hub.register("job_a")
            killed = await asyncio.to_thread(client.client_kill_filter, _type="pubsub")
            assert killed >= 1
            assert await asyncio.wait_for(waiting, 5) is False
            await listening(hub)
            again = hub.register("job_a")
            await asyncio.to_thread(publish_job_done, client, prefix=prefix, job_id="job_a",
                                    status=JobStatus.SUCCEEDED)
            assert await asyncio.wait_for(again, 5) is True
        finally:
            await hub.aclose()
            await aredis.aclose()

    asyncio.run(scenario())
