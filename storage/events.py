"""Redis pub/sub events: "job finished" and "batch finished" for long-polls, "job
cancelled" for workers, "batch waiting" for schedulers.

Responsible for: channel names (under the topic prefix), publishing both events (a job's
completion on its own channel, or a worker's whole write of results as one message on a
shared channel), an async wait for one job's completion that cannot miss a wakeup, and a
cancel subscription for workers. Events only wake waiters early; the database stays the
source of truth, so publishing is best effort (a lost event costs a waiter its timeout,
nothing more).

Lost wakeups, and the order that prevents them. A long-poll that reads the database,
sees `running`, and only then subscribes can miss a completion published in between and
sleep its whole timeout. So the order is:

    1. subscribe, and wait for Redis to confirm the subscription;
    2. re-check the database;
    3. only if the job is still unfinished, wait for the event (or the timeout).

Any completion committed after step 2's read is published after step 1 and so is heard.
`wait_job_done(..., is_done=...)` runs that order; `subscribe_job_done` lets a caller
run step 2 itself.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.client import PubSub

from storage.models import JobStatus
from storage.redis_batch import Outcome, RedisBatch
from storage.token_streams import follow_channel

logger = logging.getLogger(__name__)

# Seconds between database re-checks when Redis is unreachable during a wait.
FALLBACK_POLL_INTERVAL_S = 0.25
# Seconds to wait for Redis to confirm a subscription.
SUBSCRIBE_CONFIRM_TIMEOUT_S = 5.0

DoneCheck = Callable[[], Awaitable[bool] | bool]


def job_done_channel(prefix: str, job_id: str) -> str:
    """The channel that announces one job's completion."""
    return f"{prefix}:jobs:done:{job_id}"


def jobs_done_channel(prefix: str) -> str:
    """The one channel that announces many completions per message (`publish_jobs_done`).

    It does not match `job_done_channel(prefix, "*")`: listeners subscribe to both.
    """
    return f"{prefix}:jobs:finished"


def cancel_channel(prefix: str) -> str:
    """The one channel every worker listens on for cancellations."""
    return f"{prefix}:jobs:cancel"


def batches_wake_channel(prefix: str) -> str:
    """The channel that tells schedulers a batch awaits them (created, or to cancel)."""
    return f"{prefix}:batches:wake"


def batch_done_channel(prefix: str, batch_id: str) -> str:
    """The channel that announces a batch reached a terminal status."""
    return f"{prefix}:batches:done:{batch_id}"


def publish_batch_done(redis_client: redis.Redis, *, prefix: str, batch_id: str,
                       status: str) -> None:
    """Announce that a batch reached a terminal status (after its row is committed)."""
    _publish(redis_client, batch_done_channel(prefix, batch_id),
             json.dumps({"batch_id": batch_id, "status": status}))


def publish_batches_wake(redis_client: redis.Redis, *, prefix: str, batch_id: str) -> None:
    """Ask schedulers for a batch pass now (after the batch's row is committed); without
    it the next pass still comes within `batch_poll_interval_s`."""
    _publish(redis_client, batches_wake_channel(prefix), json.dumps({"batch_id": batch_id}))


def publish_job_done(
    redis_client: redis.Redis, *, prefix: str, job_id: str, status: JobStatus | str
) -> None:
    """Announce that a job reached a final status (after its row is committed)."""
    _publish(redis_client, job_done_channel(prefix, job_id), _job_done_payload(job_id, status))


def queue_job_done(batch: RedisBatch, *, prefix: str, job_id: str,
                   status: JobStatus | str) -> None:
    """`publish_job_done` sent with the other writes of `batch`."""
    _queue_publish(batch, job_done_channel(prefix, job_id), _job_done_payload(job_id, status))


def publish_jobs_done(
    redis_client: redis.Redis, *, prefix: str, statuses: dict[str, JobStatus]
) -> None:
    """Announce many jobs' final statuses in one message on `jobs_done_channel`.

    A worker stores an engine step's results together, and one PUBLISH per job cost it
    ~80 us of CPU per job (its pipeline's replies parsed one by one) and cost each
    listening API a message to read per job; one message per write costs both one.
    """
    if statuses:
        _publish(redis_client, jobs_done_channel(prefix), _jobs_done_payload(statuses))


def queue_jobs_done(batch: RedisBatch, *, prefix: str,
                    statuses: dict[str, JobStatus]) -> None:
    """`publish_jobs_done` sent with the other writes of `batch` (the worker's store of a
    step's results: its cache fill, this, and the token settling in one round trip)."""
    if statuses:
        _queue_publish(batch, jobs_done_channel(prefix), _jobs_done_payload(statuses))


def _job_done_payload(job_id: str, status: JobStatus | str) -> str:
    status_value = status.value if isinstance(status, JobStatus) else status
    return json.dumps({"job_id": job_id, "status": status_value})


def _jobs_done_payload(statuses: dict[str, JobStatus]) -> str:
    return json.dumps({"jobs": {job_id: status.value for job_id, status in statuses.items()}},
                      separators=(",", ":"))


def announced_job_ids(data: bytes | str) -> list[str]:
    """The job ids a `publish_jobs_done` message announces; none for a malformed one."""
    try:
        jobs = json.loads(data).get("jobs")
    except (ValueError, AttributeError):
        return []
    return [job_id for job_id in jobs if isinstance(job_id, str)] if isinstance(jobs, dict) else []


def publish_cancel(redis_client: redis.Redis, *, prefix: str, job_id: str) -> None:
    """Ask every worker to abort a job (after its row says cancelled)."""
    _publish(redis_client, cancel_channel(prefix), json.dumps({"job_id": job_id}))


def _publish(redis_client: redis.Redis, channel: str, payload: str) -> None:
    """PUBLISH, logging instead of raising: waiters still have the database and a timeout."""
    try:
        redis_client.publish(channel, payload)
    except redis.RedisError as e:
        _publish_failed(channel, e)


def _queue_publish(batch: RedisBatch, channel: str, payload: str) -> None:
    """`_publish` as part of `batch`: a failure is logged when the batch executes."""
    def done(outcome: Outcome) -> None:
        if isinstance(outcome, redis.RedisError):
            _publish_failed(channel, outcome)

    batch.add(lambda pipe: pipe.publish(channel, payload), done)


def _publish_failed(channel: str, error: redis.RedisError) -> None:
    logger.warning("could not publish to %s (%s); waiters fall back to timeouts", channel,
                   error)


class JobDoneSubscription:
    """A confirmed subscription to one job's completion: its own channel and the channel
    of grouped announcements (`jobs_done_channel`)."""

    def __init__(self, pubsub: aioredis.client.PubSub, channel: str, *, job_id: str,
                 grouped_channel: str) -> None:
        self._pubsub = pubsub
        self._channel = channel
        self._job_id = job_id
        self._grouped_channel = grouped_channel

    async def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the event; True if it came."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while (remaining := deadline - time.monotonic()) > 0:
            message = await self._pubsub.get_message(
                ignore_subscribe_messages=True, timeout=remaining
            )
            if message is None:
                continue
            channel = _channel_of(message)
            if channel == self._channel or (channel == self._grouped_channel and self._job_id
                                            in announced_job_ids(message["data"])):
                return True
        return False


@asynccontextmanager
async def _subscribed(aredis: aioredis.Redis,
                      channels: tuple[str, ...]) -> AsyncIterator[aioredis.client.PubSub]:
    """A pub/sub connection subscribed to `channels`, confirmed by Redis before it is
    handed over; unsubscribed and closed after."""
    pubsub = aredis.pubsub()
    try:
        await pubsub.subscribe(*channels)
        await _confirm_subscribed(pubsub, set(channels))
        yield pubsub
    finally:
        try:
            await pubsub.unsubscribe(*channels)
        except redis.RedisError as e:
            logger.debug("unsubscribe from %s failed: %s", channels, e)
        await pubsub.aclose()


@asynccontextmanager
async def subscribe_job_done(
    aredis: aioredis.Redis, *, prefix: str, job_id: str
) -> AsyncIterator[JobDoneSubscription]:
    """Subscribe to a job's completion; re-check the database inside, then `wait`."""
    channels = (job_done_channel(prefix, job_id), jobs_done_channel(prefix))
    async with _subscribed(aredis, channels) as pubsub:
        yield JobDoneSubscription(pubsub, channels[0], job_id=job_id,
                                  grouped_channel=channels[1])


async def _confirm_subscribed(pubsub: aioredis.client.PubSub, channels: set[str]) -> None:
    """Block until Redis acknowledges SUBSCRIBE to every channel; before that a PUBLISH
    could be missed."""
    deadline = time.monotonic() + SUBSCRIBE_CONFIRM_TIMEOUT_S
    waiting = set(channels)
    while (remaining := deadline - time.monotonic()) > 0:
        message = await pubsub.get_message(timeout=remaining)
        if message is not None and message["type"] == "subscribe":
            waiting.discard(_channel_of(message))
            if not waiting:
                return
    raise redis.TimeoutError(f"Redis did not confirm the subscription to {sorted(waiting)}")


async def wait_job_done(
    aredis: aioredis.Redis,
    *,
    prefix: str,
    job_id: str,
    timeout: float,
    is_done: DoneCheck | None = None,
) -> bool:
    """Wait for a job's completion event or the timeout; True if the job is known done.

    Pass `is_done` (a sync or async database check): it runs after the subscription is
    confirmed, which closes the lost-wakeup window (see the module docstring). Without
    it, a completion published before this call subscribed is missed. The caller reads
    the database afterwards either way. If Redis is unreachable, `is_done` is polled
    until the timeout instead.
    """
    try:
        async with subscribe_job_done(aredis, prefix=prefix, job_id=job_id) as subscription:
            if is_done is not None and await _call(is_done):
                return True
            return await subscription.wait(timeout)
    except redis.RedisError as e:
        logger.warning("job %s: Redis unavailable for long-poll (%s); polling instead", job_id, e)
        return await poll_until_done(is_done, timeout)


async def wait_batch_done(
    aredis: aioredis.Redis,
    *,
    prefix: str,
    batch_id: str,
    timeout: float,
    is_done: DoneCheck,
) -> bool:
    """Wait for a batch's terminal-status event or the timeout; True if the batch is known
    done. `is_done` runs once the subscription is confirmed, as in `wait_job_done`; where
    Redis is unreachable it is polled instead until the timeout.

    A batch has one waiter or a few (its submitter's client), so each wait subscribes on
    its own, unlike a job's long-polls, which share the API process's hub.
    """
    try:
        async with _subscribed(aredis, (batch_done_channel(prefix, batch_id),)) as pubsub:
            if await _call(is_done):
                return True
            deadline = time.monotonic() + max(timeout, 0.0)
            while (remaining := deadline - time.monotonic()) > 0:
                if await pubsub.get_message(ignore_subscribe_messages=True,
                                            timeout=remaining) is not None:
                    return True
            return False
    except redis.RedisError as e:
        logger.warning("batch %s: Redis unavailable for long-poll (%s); polling instead",
                       batch_id, e)
        return await poll_until_done(is_done, timeout)


async def poll_until_done(is_done: DoneCheck | None, timeout: float) -> bool:
    """Re-check the database every FALLBACK_POLL_INTERVAL_S until done or the timeout."""
    deadline = time.monotonic() + max(timeout, 0.0)
    while True:
        if is_done is not None and await _call(is_done):
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        await asyncio.sleep(min(FALLBACK_POLL_INTERVAL_S, remaining))


async def _call(check: DoneCheck) -> bool:
    """Run a sync or async check."""
    outcome = check()
    if inspect.isawaitable(outcome):
        outcome = await outcome
    return bool(outcome)


class CancelSubscription:
    """A worker's subscription to cancellations: `poll` returns newly cancelled job ids.

    It also hears the follow channel (`storage.token_streams.follow_channel`): the ids of
    jobs an API process asks to be streamed gather in `follows` until taken.
    """

    def __init__(self, redis_client: redis.Redis, *, prefix: str) -> None:
        self._channel = cancel_channel(prefix)
        self._follow_channel = follow_channel(prefix)
        self.follows: list[str] = []
        self._pubsub: PubSub = redis_client.pubsub()
        self._pubsub.subscribe(self._channel, self._follow_channel)
        # Confirmed before returning, so a cancel published after this is never missed.
        waiting = {self._channel, self._follow_channel}
        deadline = time.monotonic() + SUBSCRIBE_CONFIRM_TIMEOUT_S
        while (remaining := deadline - time.monotonic()) > 0:
            message = self._pubsub.get_message(timeout=remaining)
            if message is not None and message["type"] == "subscribe":
                waiting.discard(_channel_of(message))
                if not waiting:
                    return
        self._pubsub.close()
        raise redis.TimeoutError(f"Redis did not confirm the subscription to {self._channel}")

    def poll(self, timeout: float = 0.0) -> list[str]:
        """Job ids cancelled since the last poll; waits up to `timeout` for the first."""
        job_ids: list[str] = []
        message = self._pubsub.get_message(timeout=timeout)
        # A worker polls every loop pass and almost always finds nothing: one read then.
        while message is not None:
            if message.get("type") == "message" and _channel_of(message) == self._follow_channel:
                self.follows.append(_text(message["data"]))
            elif (job_id := _cancelled_job_id(message)) is not None:
                job_ids.append(job_id)
            message = self._pubsub.get_message(timeout=0.0)
        return job_ids

    def take_follows(self) -> list[str]:
        """Job ids whose streaming was asked for since the last call."""
        follows, self.follows = self.follows, []
        return follows

    def close(self) -> None:
        """Unsubscribe and release the connection."""
        self._pubsub.close()

    def __enter__(self) -> CancelSubscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _cancelled_job_id(message: dict[str, Any]) -> str | None:
    """The job id in a cancel message, or None for anything malformed."""
    if message.get("type") != "message":
        return None
    try:
        job_id = json.loads(message["data"])["job_id"]
    except (ValueError, KeyError, TypeError):
        logger.warning("ignoring malformed cancel message %r", message.get("data"))
        return None
    return job_id if isinstance(job_id, str) else None


def _channel_of(message: dict[str, Any]) -> str:
    """A pub/sub message's channel as text, whether the client decodes responses or not."""
    return _text(message["channel"])


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
