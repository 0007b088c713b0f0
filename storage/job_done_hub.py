"""One subscription per API process to every job's completion, shared by its long-polls.

Why: a long-poll with its own pub/sub connection subscribes, waits for Redis to confirm,
re-reads the database, then unsubscribes and closes: three Redis round trips, a
connection and an extra database read per request. At a few hundred long-polls a second
that was most of the API's CPU per job. The hub pattern-subscribes once to every job's
done channel (`storage.events.job_done_channel`), subscribes to the channel of grouped
announcements (`jobs_done_channel`, one message per worker write), and wakes the waiters
registered for the job ids it hears.

Lost wakeups (see storage.events for the general order). A waiter registers with the hub
(a dict entry, no I/O) before it reads the database. While the hub is listening, its
subscription is confirmed, so a completion committed after that read is published after
the registration and wakes it. A waiter checks `is_listening` when it registers: while
the hub starts, or after it lost Redis and until it has subscribed again, waiters take
the per-request path instead. When the hub loses its connection it wakes every waiter
with False: they cannot know what was missed and poll the database for the rest of their
wait.

Views with the wake-up. A worker announces a whole write's finished jobs in one message;
each waiter woken by it would then read its own job: one query per job, the most frequent
statement of a busy API. Given `read_views`, the hub reads the views of the announced jobs
that have waiters in one query and wakes each waiter with its job's view instead of True.
A waiter checks the view's tenant and status as its own read would; where the read fails,
takes over VIEW_READ_TIMEOUT_S or misses a job, that waiter hears True and reads for itself.

Jobs expected. A client long-polls the job it has just submitted, usually before the job
has finished; the waiter's first read then only finds it queued (~15% of the API's event
loop end to end at 1,000 jobs/s). The API tells the hub of each job it is about to store
(`expect`, before the row is written, so before any completion of it can be announced),
and the hub forgets the job once it hears anything of it. A waiter registered while its
job is still expected and unheard (`unheard`) knows the job's completion is yet to be
announced, and so will wake it: it skips the first read. Only what the hub heard
continuously counts: losing the subscription forgets every expected job, and a job is
expected for EXPECT_S at most (its waiters then read first, as any other).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import redis
import redis.asyncio as aioredis

from storage.events import (
    SUBSCRIBE_CONFIRM_TIMEOUT_S,
    announced_job_ids,
    job_done_channel,
    jobs_done_channel,
)

logger = logging.getLogger(__name__)

# Seconds between attempts to subscribe again after losing Redis (doubling up to the max).
RESUBSCRIBE_BACKOFF_S = 0.1
RESUBSCRIBE_BACKOFF_MAX_S = 5.0

# The views of finished jobs by id (those it finds), for waiters woken by an announcement.
ViewReader = Callable[[list[str]], Awaitable[Mapping[str, Any]]]
# Seconds the hub waits for such a read: announcements arriving meanwhile wait behind it,
# so a stalled database must not hold up every long-poll's wake-up for longer.
VIEW_READ_TIMEOUT_S = 1.0
# How long a job stays expected, and how many are at most (the oldest go first): enough
# for a long-poll sent just after its submission, bounded where no worker takes the jobs.
EXPECT_S = 30.0
MAX_EXPECTED = 65_536
# How long aclose waits for the listening task to end, and how often it cancels it again
# meanwhile (also the bound on closing a subscription's connection).
CLOSE_TIMEOUT_S = 5.0
CLOSE_RETRY_S = 0.5


class JobDoneHub:
    """Wakes registered waiters when their job's completion is published (module docstring)."""

    def __init__(self, aredis: aioredis.Redis, *, prefix: str) -> None:
        self._aredis = aredis
        self._pattern = job_done_channel(prefix, "*")
        self._grouped_channel = jobs_done_channel(prefix)
        self._channel_start = len(job_done_channel(prefix, ""))
        self._waiters: dict[str, set[asyncio.Future[Any]]] = {}
        self._listening = False
        self._task: asyncio.Task[None] | None = None
        self._read_views: ViewReader | None = None
        self._expected: dict[str, str] = {}  # job id -> tenant id, unheard of since
        self._expiries: deque[tuple[float, str]] = deque()
        # Set by aclose: the listening loop ends at its next turn even if a cancellation
        # was lost on the way (Python 3.11's wait_for can swallow one that lands as the
        # awaited read completes; the loop would then subscribe again for ever).
        self._closing = False

    @property
    def is_listening(self) -> bool:
        """True while the subscription is confirmed and read: registering is then enough."""
        return self._listening

    def start(self, read_views: ViewReader | None = None) -> None:
        """Subscribe and listen in a task of the running event loop; `read_views` reads
        announced jobs' views for their waiters (module docstring)."""
        self._read_views = read_views
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="job-done-hub")

    async def aclose(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop listening; waiters still registered are woken with False.

        Returns within about timeout_s whatever the listening task does: a task that has
        not ended by then is left behind (logged), never waited on for ever.
        """
        self._closing = True
        task, self._task = self._task, None
        if task is None:
            return
        deadline = time.monotonic() + timeout_s
        while not task.done() and (remaining := deadline - time.monotonic()) > 0:
            task.cancel()  # again each turn: one cancellation may be swallowed
            await asyncio.wait({task}, timeout=min(remaining, CLOSE_RETRY_S))
        if not task.done():
            logger.warning("the long-poll hub did not stop within %.1fs; leaving it",
                           timeout_s)
        elif not task.cancelled() and task.exception() is not None:
            logger.warning("the long-poll hub ended with %r", task.exception())

    def register(self, job_id: str) -> asyncio.Future[Any]:
        """A future that becomes True (or, from an announcement with `read_views`, the job's
        view) when the job's completion is heard, or False when the hub loses Redis.
        Unregister it when done waiting."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(job_id, set()).add(future)
        return future

    def expect(self, job_id: str, tenant_id: str) -> None:
        """Note a job about to be stored, before it is (module docstring): until the hub
        hears of it, `unheard` says its completion is yet to come."""
        if not self._listening:
            return
        now = time.monotonic()
        self._forget_expired(now)
        self._expected[job_id] = tenant_id
        self._expiries.append((now + EXPECT_S, job_id))

    def forget(self, job_id: str) -> None:
        """The job will not be stored after all (its submission was refused)."""
        self._expected.pop(job_id, None)

    def unheard(self, job_id: str, tenant_id: str) -> bool:
        """True when the tenant's job is expected and nothing of it was heard since: its
        completion is still to be announced, and will wake a waiter registered now."""
        self._forget_expired(time.monotonic())
        return self._listening and self._expected.get(job_id) == tenant_id

    def _forget_expired(self, now: float) -> None:
        expiries = self._expiries
        while expiries and (expiries[0][0] <= now or len(expiries) > MAX_EXPECTED):
            self._expected.pop(expiries.popleft()[1], None)

    def unregister(self, job_id: str, future: asyncio.Future[Any]) -> None:
        """Forget a waiter (after it woke, timed out or was cancelled)."""
        waiting = self._waiters.get(job_id)
        if waiting is not None:
            waiting.discard(future)
            if not waiting:
                del self._waiters[job_id]

    async def _run(self) -> None:
        backoff = RESUBSCRIBE_BACKOFF_S
        while not self._closing:
            pubsub = self._aredis.pubsub()
            try:
                await pubsub.psubscribe(self._pattern)
                await pubsub.subscribe(self._grouped_channel)
                await self._confirm(pubsub)
                self._listening, backoff = True, RESUBSCRIBE_BACKOFF_S
                logger.debug("listening for job completions on %s", self._pattern)
                while not self._closing:
                    message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                       timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "pmessage":
                        job_id = _text(message["channel"])[self._channel_start:]
                        self._expected.pop(job_id, None)
                        self._wake(job_id, True)
                    elif message["type"] == "message":  # only the grouped channel's
                        job_ids = announced_job_ids(message["data"])
                        for job_id in job_ids:
                            self._expected.pop(job_id, None)
                        await self._wake_announced(job_ids)
            except Exception as e:  # Redis lost, or no confirmation: subscribe again
                logger.warning("long-poll subscription lost (%r); waiters poll the database "
                               "until it is back", e)
            finally:
                self._listening = False
                self._expected.clear()  # what was missed meanwhile is unknown
                self._expiries.clear()
                for job_id in list(self._waiters):
                    self._wake(job_id, False)
                try:
                    # Bounded: the finally of a cancelled task must not wait for ever.
                    await asyncio.wait_for(pubsub.aclose(), CLOSE_RETRY_S)
                except (redis.RedisError, OSError, TimeoutError):
                    pass
            if self._closing:
                break
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESUBSCRIBE_BACKOFF_MAX_S)

    async def _confirm(self, pubsub: aioredis.client.PubSub) -> None:
        """Until Redis acknowledges the PSUBSCRIBE and the SUBSCRIBE, a PUBLISH could be
        missed."""
        waiting = {"psubscribe", "subscribe"}
        async with asyncio.timeout(SUBSCRIBE_CONFIRM_TIMEOUT_S):
            while waiting:
                message = await pubsub.get_message(timeout=SUBSCRIBE_CONFIRM_TIMEOUT_S)
                if message is not None:
                    waiting.discard(message["type"])

    async def _wake_announced(self, job_ids: list[str]) -> None:
        waited = [job_id for job_id in job_ids if job_id in self._waiters]
        if not waited:
            return
        views: Mapping[str, Any] = {}
        if self._read_views is not None:
            try:
                views = await asyncio.wait_for(self._read_views(waited), VIEW_READ_TIMEOUT_S)
            except Exception as e:  # the database: each waiter reads for itself
                logger.warning("reading %d finished job(s) for their long-polls failed (%r); "
                               "each reads its own", len(waited), e)
        for job_id in waited:
            self._wake(job_id, views.get(job_id, True))

    def _wake(self, job_id: str, heard: Any) -> None:
        for future in self._waiters.pop(job_id, ()):
            if not future.done():
                future.set_result(heard)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
