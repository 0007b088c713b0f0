"""Completion and cancel events over a real Redis: no lost wakeups, timeouts hold; the
API's one shared subscription to completions (JobDoneHub)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from storage.events import (
    CancelSubscription,
    batch_done_channel,
    job_done_channel,
    jobs_done_channel,
    publish_batch_done,
    publish_cancel,
    publish_job_done,
    publish_jobs_done,
    subscribe_job_done,
    wait_batch_done,
    wait_job_done,
)
from storage.job_done_hub import JobDoneHub, ViewReader
from storage.models import JobStatus


@pytest.fixture
def prefix() -> str:
    """A channel prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client(redis_client: redis.Redis) -> redis.Redis:
    """A synchronous client, as workers use."""
    return redis_client


def wait_for_subscriber(client: redis.Redis, channel: str, timeout: float = 30.0) -> None:
    """Until someone subscribes to channel: a completion published before a wait has
    subscribed is missed by design (`storage.events.wait_job_done`), so publishing after a
    fixed delay races the subscription on a busy machine."""
    deadline = time.monotonic() + timeout
    while not dict(client.pubsub_numsub(channel)).get(channel.encode()):
        assert time.monotonic() < deadline, f"nobody subscribed to {channel}"
        time.sleep(0.01)


def publish_later(
    client: redis.Redis, prefix: str, job_id: str, delay_s: float,
    waiter_job_id: str | None = None,
) -> threading.Thread:
    """Publish a completion from another thread `delay_s` after the channel of the job
    waited for (waiter_job_id, default job_id) has a subscriber. The caller joins the
    thread before its test ends: the `client` fixture closes the connection at teardown,
    and a publish still under way then fails in the thread."""

    def run() -> None:
        wait_for_subscriber(client, job_done_channel(prefix, waiter_job_id or job_id))
        time.sleep(delay_s)
        publish_job_done(client, prefix=prefix, job_id=job_id, status=JobStatus.SUCCEEDED)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_wait_returns_as_soon_as_the_job_is_done(
    redis_url: str, client: redis.Redis, prefix: str
) -> None:
    async def scenario() -> tuple[bool, float]:
        aredis = aioredis.Redis.from_url(redis_url)
        try:
            publisher = publish_later(client, prefix, "job_a", delay_s=0.3)
            start = time.monotonic()
            done = await wait_job_done(aredis, prefix=prefix, job_id="job_a", timeout=30)
            elapsed = time.monotonic() - start
            await asyncio.to_thread(publisher.join, 30)
            return done, elapsed
        finally:
            await aredis.aclose()

    done, elapsed = asyncio.run(scenario())
    assert done
    assert 0.3 <= elapsed < 10  # woken by the completion, far before the timeout


def test_wait_times_out_and_ignores_other_jobs(
    redis_url: str, client: redis.Redis, prefix: str
) -> None:
    async def scenario() -> tuple[bool, float, bool]:
        aredis = aioredis.Redis.from_url(redis_url)
        try:
            publisher = publish_later(client, prefix, "job_other", delay_s=0.1,
                                      waiter_job_id="job_a")
            start = time.monotonic()
            done = await wait_job_done(aredis, prefix=prefix, job_id="job_a", timeout=2.0)
            elapsed = time.monotonic() - start
            await asyncio.to_thread(publisher.join, 30)
            return done, elapsed, publisher.is_alive()
        finally:
            await aredis.aclose()

    done, elapsed, is_publishing = asyncio.run(scenario())
    assert not is_publishing, "the other job's completion was never published"
    assert not done
    assert 1.9 < elapsed < 10


def test_completion_between_subscribe_and_recheck_is_not_lost(
    redis_url: str, client: redis.Redis, prefix: str
) -> None:
    """The worst interleaving: the job finishes right after the subscription is confirmed.

    The database re-check (here a flag) still says unfinished because it ran first; the
    event published just after must still wake the waiter long before its timeout.
    """
    database_says_done = threading.Event()

    async def scenario() -> tuple[bool, float]:
        aredis = aioredis.Redis.from_url(redis_url)
        try:
            start = time.monotonic()
            async with subscribe_job_done(aredis, prefix=prefix, job_id="job_a") as sub:
                assert not database_says_done.is_set()  # the re-check: still running
                database_says_done.set()  # worker commits...
                publish_job_done(client, prefix=prefix, job_id="job_a", status="succeeded")
                done = await sub.wait(timeout=10)
            return done, time.monotonic() - start
        finally:
            await aredis.aclose()

    done, elapsed = asyncio.run(scenario())
    assert done and elapsed < 2


def test_is_done_check_runs_after_subscribing(redis_url: str, prefix: str) -> None:
    calls: list[str] = []

    async def already_done() -> bool:
        calls.append("checked")
        return True

    async def scenario() -> tuple[bool, float]:
        aredis = aioredis.Redis.from_url(redis_url)
        try:
            start = time.monotonic()
            done = await wait_job_done(
                aredis, prefix=prefix, job_id="job_a", timeout=10, is_done=already_done
            )
            return done, time.monotonic() - start
        finally:
            await aredis.aclose()

    done, elapsed = asyncio.run(scenario())
    assert done and calls == ["checked"] and elapsed < 2


@pytest.mark.parametrize("waiting_for", ["job", "batch"])
def test_unreachable_redis_falls_back_to_polling_the_check(prefix: str,
                                                           waiting_for: str) -> None:
    polls: list[float] = []

    def done_on_third_poll() -> bool:
        polls.append(time.monotonic())
        return len(polls) >= 3

    async def scenario() -> bool:
        aredis = aioredis.Redis(host="127.0.0.1", port=1, retry=AsyncRetry(NoBackoff(), 0))
        try:
            if waiting_for == "batch":
                return await wait_batch_done(aredis, prefix=prefix, batch_id="batch_a",
                                             timeout=5, is_done=done_on_third_poll)
            return await wait_job_done(
                aredis, prefix=prefix, job_id="job_a", timeout=5, is_done=done_on_third_poll
            )
        finally:
            await aredis.aclose()

    assert asyncio.run(scenario())
    assert len(polls) == 3


def test_a_batch_wait_ends_on_its_own_batch_event_only(
    redis_url: str, client: redis.Redis, prefix: str
) -> None:
    """Another batch's end leaves the wait running; its own ends it at once. The check
    runs after the subscription is confirmed, once."""
    checks: list[float] = []

    def still_running() -> bool:
        checks.append(time.monotonic())
        return False

    def publish() -> None:
        # Both after the wait subscribed: the other batch's end is heard and ignored, and
        # the own one cannot fall before the subscription (it would be missed by design).
        wait_for_subscriber(client, batch_done_channel(prefix, "batch_a"))
        publish_batch_done(client, prefix=prefix, batch_id="batch_other", status="completed")
        time.sleep(0.5)
        publish_batch_done(client, prefix=prefix, batch_id="batch_a", status="completed")

    async def scenario() -> tuple[bool, float]:
        aredis = aioredis.Redis.from_url(redis_url)
        try:
            publisher = threading.Thread(target=publish, daemon=True)
            publisher.start()
            start = time.monotonic()
            done = await wait_batch_done(aredis, prefix=prefix, batch_id="batch_a",
                                         timeout=30, is_done=still_running)
            elapsed = time.monotonic() - start
            await asyncio.to_thread(publisher.join, 30)
            return done, elapsed
        finally:
            await aredis.aclose()

    done, elapsed = asyncio.run(scenario())
    assert done and 0.5 <= elapsed < 30
    assert len(checks) == 1


def test_a_batch_wait_times_out_or_ends_on_the_check(redis_url: str, prefix: str) -> None:
    async def scenario(is_done: bool, timeout: float) -> tuple[bool, float]:
        aredis = aioredis.Redis.from_url(redis_url)
        try:
            start = time.monotonic()
            done = await wait_batch_done(aredis, prefix=prefix, batch_id="batch_a",
                                         timeout=timeout, is_done=lambda: is_done)
            return done, time.monotonic() - start
        finally:
            await aredis.aclose()

    done, elapsed = asyncio.run(scenario(False, timeout=0.6))
    assert not done and 0.5 < elapsed < 3
    # A long timeout: a check that says done ends the wait at once, not at the timeout.
    done, elapsed = asyncio.run(scenario(True, timeout=30))
    assert done and elapsed < 10


def test_publishing_to_an_unreachable_redis_does_not_raise(prefix: str) -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    publish_job_done(dead, prefix=prefix, job_id="job_a", status=JobStatus.FAILED)
    publish_cancel(dead, prefix=prefix, job_id="job_a")
    publish_batch_done(dead, prefix=prefix, batch_id="batch_a", status="completed")


def poll_until(subscription: CancelSubscription, job_id: str,
               timeout: float = 30.0) -> list[str]:
    """Every cancelled job id polled, up to and including `job_id`."""
    heard: list[str] = []
    deadline = time.monotonic() + timeout
    while job_id not in heard:
        assert time.monotonic() < deadline, f"{job_id} never heard; heard {heard}"
        heard += subscription.poll(timeout=0.1)
    return heard


def test_workers_hear_every_cancel(client: redis.Redis, redis_url: str, prefix: str) -> None:
    other = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        with (
            CancelSubscription(client, prefix=prefix) as first,
            CancelSubscription(other, prefix=prefix) as second,
        ):
            assert first.poll(timeout=0.05) == []
            publish_cancel(client, prefix=prefix, job_id="job_a")
            publish_cancel(client, prefix=prefix, job_id="job_b")
            client.publish(f"{prefix}:jobs:cancel", "not json")
            publish_cancel(client, prefix=f"{prefix}x", job_id="job_elsewhere")
            # A marker last: once it is heard, the junk and the other prefix's cancel
            # before it were heard too, and gave nothing.
            publish_cancel(client, prefix=prefix, job_id="job_marker")
            expected = ["job_a", "job_b", "job_marker"]
            assert poll_until(first, "job_marker") == expected
            assert poll_until(second, "job_marker") == expected
            assert first.poll(timeout=0.05) == []
    finally:
        other.close()


@asynccontextmanager
async def running_hub(redis_url: str, prefix: str,
                      read_views: ViewReader | None = None) -> AsyncIterator[JobDoneHub]:
    """A started hub on its own client, listening; closed afterwards."""
    aredis = aioredis.Redis.from_url(redis_url)
    hub = JobDoneHub(aredis, prefix=prefix)
    hub.start(read_views)
    try:
        await listening(hub)
        yield hub
    finally:
        await hub.aclose()
        await aredis.aclose()


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
        async with running_hub(redis_url, prefix) as hub:
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

    asyncio.run(scenario())


def test_a_lost_subscription_wakes_waiters_with_false_and_comes_back(
    redis_url: str, client: redis.Redis, prefix: str
) -> None:
    """Redis drops the hub's connection: every waiter hears False (it cannot know what it
    missed), the hub stops claiming to listen, subscribes again, and wakes new waiters."""
    async def scenario() -> None:
        async with running_hub(redis_url, prefix) as hub:
            waiting = hub.register("job_a")
            killed = await asyncio.to_thread(client.client_kill_filter, _type="pubsub")
            assert killed >= 1
            assert await asyncio.wait_for(waiting, 5) is False
            await listening(hub)
            again = hub.register("job_a")
            await asyncio.to_thread(publish_job_done, client, prefix=prefix, job_id="job_a",
                                    status=JobStatus.SUCCEEDED)
            assert await asyncio.wait_for(again, 5) is True

    asyncio.run(scenario())


def test_a_lone_wait_hears_a_grouped_announcement_of_its_job_only(
    redis_url: str, client: redis.Redis, prefix: str
) -> None:
    """A wait with a subscription of its own (the hub not listening) hears a worker's
    write announced as one message: it ignores a message without its job and wakes on the
    one that names it."""
    async def scenario() -> tuple[bool, float]:
        aredis = aioredis.Redis.from_url(redis_url)

        def announce() -> None:
            wait_for_subscriber(client, jobs_done_channel(prefix))
            time.sleep(0.3)
            publish_jobs_done(client, prefix=prefix, statuses={"job_b": JobStatus.SUCCEEDED})
            time.sleep(0.3)
            publish_jobs_done(client, prefix=prefix, statuses={
                "job_c": JobStatus.FAILED, "job_a": JobStatus.SUCCEEDED})

        started = time.monotonic()
        try:
            thread = threading.Thread(target=announce, daemon=True)
            thread.start()
            heard = await wait_job_done(aredis, prefix=prefix, job_id="job_a", timeout=30)
            await asyncio.to_thread(thread.join, 30)
            return heard, time.monotonic() - started
        finally:
            await aredis.aclose()

    heard, seconds = asyncio.run(scenario())
    assert heard and seconds > 0.5  # not woken by the first message, without its job


def test_an_announcement_wakes_its_waiters_with_views_read_in_one_call(
    redis_url: str, client: redis.Redis, prefix: str
) -> None:
    """With a view reader, one grouped announcement costs one read of the jobs that have
    waiters (not of the others), and each waiter hears its job's view; a job the read
    missed wakes with True, as does every waiter when the read fails, and the hub goes on
    listening, and when the read stalls; a lone job's announcement wakes with True,
    unread."""
    reads: list[list[str]] = []
    failing = stalling = False

    async def read_views(job_ids: list[str]) -> dict[str, str]:
        reads.append(job_ids)
        if failing:
            raise OSError("database unreachable")
        if stalling:
            await asyncio.sleep(60)
        return {job_id: f"view of {job_id}" for job_id in job_ids if job_id != "job_gone"}

    async def scenario() -> None:
        nonlocal failing, stalling
        async with running_hub(redis_url, prefix, read_views) as hub:
            a, b, gone = hub.register("job_a"), hub.register("job_b"), hub.register("job_gone")
            await asyncio.to_thread(publish_jobs_done, client, prefix=prefix, statuses={
                "job_a": JobStatus.SUCCEEDED, "job_x": JobStatus.SUCCEEDED,
                "job_b": JobStatus.FAILED, "job_gone": JobStatus.SUCCEEDED})
            assert await asyncio.wait_for(a, 5) == "view of job_a"
            assert await asyncio.wait_for(b, 5) == "view of job_b"
            assert await asyncio.wait_for(gone, 5) is True
            assert reads == [["job_a", "job_b", "job_gone"]]
            failing = True
            c = hub.register("job_c")
            await asyncio.to_thread(publish_jobs_done, client, prefix=prefix,
                                    statuses={"job_c": JobStatus.SUCCEEDED})
            assert await asyncio.wait_for(c, 5) is True
            assert hub.is_listening
            d = hub.register("job_d")
            await asyncio.to_thread(publish_job_done, client, prefix=prefix, job_id="job_d",
                                    status=JobStatus.SUCCEEDED)
            assert await asyncio.wait_for(d, 5) is True
            assert len(reads) == 2
            failing, stalling = False, True  # a stalled read holds the wake-up 1 s at most
            e = hub.register("job_e")
            started = time.monotonic()
            await asyncio.to_thread(publish_jobs_done, client, prefix=prefix,
                                    statuses={"job_e": JobStatus.SUCCEEDED})
            assert await asyncio.wait_for(e, 5) is True
            assert 0.9 < time.monotonic() - started < 3 and len(reads) == 3

    asyncio.run(scenario())


def test_a_job_is_expected_until_anything_of_it_is_heard(
    redis_url: str, client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`unheard` holds for the tenant's expected job until its own or a grouped
    announcement names it, `forget` or EXPECT_S ends it, MAX_EXPECTED bounds how many, and
    losing the subscription forgets them all (what was missed meanwhile is unknown)."""
    async def heard_of(hub: JobDoneHub, job_id: str, announce: Any = None) -> None:
        """Until the hub has heard what `announce` publishes of the job (or lost Redis)."""
        woken = hub.register(job_id)
        if announce is not None:
            await asyncio.to_thread(announce)
        await asyncio.wait_for(woken, 5)
        hub.unregister(job_id, woken)

    async def scenario() -> None:
        aredis = aioredis.Redis.from_url(redis_url)
        idle = JobDoneHub(aredis, prefix=prefix)
        idle.expect("job_a", "t1")  # not listening: nothing it does not hear is known
        assert not idle.unheard("job_a", "t1")
        await aredis.aclose()
        async with running_hub(redis_url, prefix) as hub:
            monkeypatch.setattr("storage.job_done_hub.EXPECT_S", 0.0)
            hub.expect("job_g", "t1")
            assert not hub.unheard("job_g", "t1")
            monkeypatch.undo()
            for job_id in ("job_a", "job_b", "job_c", "job_d"):
                hub.expect(job_id, "t1")
            assert hub.unheard("job_a", "t1") and not hub.unheard("job_a", "t2")
            assert not hub.unheard("job_x", "t1")
            await heard_of(hub, "job_a", partial(
                publish_job_done, client, prefix=prefix, job_id="job_a",
                status=JobStatus.SUCCEEDED))
            await heard_of(hub, "job_b", partial(
                publish_jobs_done, client, prefix=prefix, statuses={"job_b": JobStatus.FAILED}))
            assert not hub.unheard("job_a", "t1") and not hub.unheard("job_b", "t1")
            hub.forget("job_c")
            assert not hub.unheard("job_c", "t1") and hub.unheard("job_d", "t1")
            monkeypatch.setattr("storage.job_done_hub.MAX_EXPECTED", 2)
            hub.expect("job_e", "t1")
            hub.expect("job_f", "t1")
            assert not hub.unheard("job_d", "t1")  # the oldest went
            assert hub.unheard("job_e", "t1") and hub.unheard("job_f", "t1")
            monkeypatch.undo()
            hub.expect("job_h", "t1")
            await heard_of(hub, "job_never", partial(client.client_kill_filter, _type="pubsub"))
            assert not hub.unheard("job_h", "t1")
            await listening(hub)
            assert not hub.unheard("job_h", "t1")

    asyncio.run(scenario())
