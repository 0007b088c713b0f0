"""Per-tenant submission rate limit: a token bucket kept in Redis.

Responsible for: admitting or refusing one submission for a tenant, atomically across
every API process (the bucket lives in Redis and is updated by one Lua script, using
Redis's clock so API hosts need not agree on time), and saying how long to wait.

The bucket holds at most one second's worth of tokens (`rate` tokens), refilled
continuously at `rate` per second. Worked example, rate = 2/s: a burst of two
submissions empties the bucket; the third, 0.1 s later, finds 0.2 tokens and is told to
retry after (1 − 0.2) / 2 = 0.4 s.

The call is made on the event loop with the asyncio client: a submission needs no thread
for it. Concurrent submissions of one tenant share one script call: while a tenant's call
is in flight, later arrivals wait and then go together, asking for as many tokens as there
are of them (the bucket grants what it holds, in arrival order). At 32 submissions in
flight the script ran once per submission and was a sixth of the API's CPU; shared, it
runs about once per event-loop turn per tenant, and no submission is admitted that a call
per submission would have refused. If Redis is unreachable the limiter fails open (and
logs): a limiter outage should not turn into a submission outage, and the active-jobs cap
still bounds a tenant.
"""

from __future__ import annotations

import asyncio
import logging

import redis
import redis.asyncio as aioredis

logger = logging.getLogger(__name__)

# KEYS[1]: the bucket hash. ARGV: rate (tokens/s), capacity (tokens), wanted (tokens).
# Returns {granted, "<seconds until the next token>"}: the first `granted` of the wanted
# are admitted. Floats travel as strings because Lua numbers returned to Redis are
# truncated to integers.
_TOKEN_BUCKET_LUA = """
local rate = tonumber(ARGV[1])
local capacity = tonumber(ARGV[2])
local wanted = tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or capacity
local ts = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
local granted = math.min(wanted, math.floor(tokens))
tokens = tokens - granted
local wait = 0
if granted < wanted then
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(capacity / rate) + 1)
return {granted, tostring(wait)}
"""


class TokenBucketLimiter:
    """Admits a tenant's submissions at `rate_per_s`, with bursts up to one second's worth."""

    def __init__(self, redis_client: aioredis.Redis, *, prefix: str, rate_per_s: float) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = max(1.0, rate_per_s)
        self._prefix = prefix
        self._script = redis_client.register_script(_TOKEN_BUCKET_LUA)
        # Per tenant: submissions waiting for the next call (none while no call runs).
        self._waiting: dict[str, list[asyncio.Future[float | None]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def retry_after_s(self, tenant_id: str) -> float | None:
        """Take a token for the tenant: None when admitted, else seconds until one frees."""
        waiting = self._waiting.get(tenant_id)
        if waiting is not None:  # a call is in flight: join the next one
            future: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
            waiting.append(future)
            return await future
        self._waiting[tenant_id] = []
        try:
            (verdict,) = await self._take(tenant_id, 1)
        finally:
            if self._waiting.get(tenant_id):
                task = asyncio.get_running_loop().create_task(self._serve_waiting(tenant_id))
                self._tasks.add(task)  # the loop keeps only a weak reference to a task
                task.add_done_callback(self._tasks.discard)
            else:
                self._waiting.pop(tenant_id, None)
        return verdict

    async def _serve_waiting(self, tenant_id: str) -> None:
        """Answer whoever arrived during the last call, in calls of all that wait."""
        failure: BaseException | None = None
        try:
            while batch := self._waiting.get(tenant_id):
                self._waiting[tenant_id] = []
                try:
                    verdicts = await self._take(tenant_id, len(batch))
                except BaseException as e:
                    failure = e
                    self._waiting[tenant_id] = batch + self._waiting[tenant_id]
                    raise
                for future, verdict in zip(batch, verdicts, strict=True):
                    if not future.done():  # its request may have gone (client disconnect)
                        future.set_result(verdict)
        finally:
            # Whoever still waits hears the failure (cancelled at shutdown, or a bug) rather
            # than waiting forever; the next submission starts afresh.
            for future in self._waiting.pop(tenant_id, None) or []:
                if not future.done():
                    future.set_exception(failure or RuntimeError("rate limiter stopped"))

    async def _take(self, tenant_id: str, wanted: int) -> list[float | None]:
        """One script call for `wanted` tokens: a verdict per token, in order."""
        key = f"{self._prefix}:ratelimit:{tenant_id}"
        try:
            granted, wait = await self._script(
                keys=[key], args=[self.rate_per_s, self.capacity, wanted]
            )
        except redis.RedisError as e:
            logger.warning("rate limiter unavailable (%s); admitting tenant %s", e, tenant_id)
            return [None] * wanted
        granted = int(granted)
        return [None] * granted + [float(wait)] * (wanted - granted)
