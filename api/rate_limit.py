"""Per-tenant submission rate limit: a token bucket kept in Redis.

Responsible for: admitting or refusing one submission for a tenant, atomically across
every API process (the bucket lives in Redis and is updated by one Lua script, using
Redis's clock so API hosts need not agree on time), and saying how long to wait.

The bucket holds at most one second's worth of tokens (`rate` tokens), refilled
continuously at `rate` per second. Worked example, rate = 2/s: a burst of two
submissions empties the bucket; the third, 0.1 s later, finds 0.2 tokens and is told to
retry after (1 − 0.2) / 2 = 0.4 s.

The call is made on the event loop with the asyncio client: a submission needs no thread
for it. If Redis is unreachable the limiter fails open (and logs): a limiter outage should not
turn into a submission outage, and the active-jobs cap still bounds a tenant.
"""

from __future__ import annotations

import logging

import redis
import redis.asyncio as aioredis

logger = logging.getLogger(__name__)

# KEYS[1]: the bucket hash. ARGV: rate (tokens/s), capacity (tokens).
# Returns {1, "0"} when admitted, {0, "<seconds to wait>"} when not. Floats travel as
# strings because Lua numbers returned to Redis are truncated to integers.
_TOKEN_BUCKET_LUA = """
local rate = tonumber(ARGV[1])
local capacity = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or capacity
local ts = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
local admitted = 0
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
  admitted = 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(capacity / rate) + 1)
return {admitted, tostring(wait)}
"""


class TokenBucketLimiter:
    """Admits a tenant's submissions at `rate_per_s`, with bursts up to one second's worth."""

    def __init__(self, redis_client: aioredis.Redis, *, prefix: str, rate_per_s: float) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = max(1.0, rate_per_s)
        self._prefix = prefix
        self._script = redis_client.register_script(_TOKEN_BUCKET_LUA)

    async def retry_after_s(self, tenant_id: str) -> float | None:
        """Take a token for the tenant: None when admitted, else seconds until one frees."""
        key = f"{self._prefix}:ratelimit:{tenant_id}"
        try:
            admitted, wait = await self._script(keys=[key],
                                                args=[self.rate_per_s, self.capacity])
        except redis.RedisError as e:
            logger.warning("rate limiter unavailable (%s); admitting tenant %s", e, tenant_id)
            return None
        return None if int(admitted) == 1 else float(wait)
