"""Token budgets enforced in Redis: reserve an estimate at admission, settle the real usage.

Responsible for: counting a tenant's tokens against its budgets in Redis, which every API
process, scheduler and worker shares: a per-minute budget is a bucket refilled
continuously at limit/60 tokens a second that holds BURST_S seconds of refill (so usage
is spread evenly and no minute holds much more than the budget, whatever the clock says),
a per-day budget a count per UTC day; admitting a job (or the first
jobs of a list, for a batch's lines) only while every budget it counts against has room;
remembering each admitted job's reservation under its id, so the worker that finishes it
replaces the estimate by what the job really used (`settle`), without knowing the budgets.

Both steps are one Lua script each, so concurrent admissions cannot overshoot a budget
and time follows Redis's clock, not the hosts'. A day's counter key is
`<base>:<day index>` (index = floor(unix time / 86400)); it expires two days later.

A job estimated above what a budget can hold still runs: a bucket admits it when full
(and goes into debt, refilling from below zero), a day admits it when nothing else is
counted yet. Refusing it forever would be worse (a batch line would wait for ever).

Worked example, 6,000 tokens/minute (100 a second, bucket of 100): a job estimated at 80
is admitted (level 20); the next, of 80, is told to retry in 0.6 s (when the level is
back to 80); a job of 300 waits until the bucket is full (0.8 s), then takes it to -200.
A job that used 50 of its 80 gives 30 back when it is settled.

Keys are built inside the scripts from the time, so this needs a single Redis (not a
cluster), as the rest of the service's Redis use does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from storage.redis_batch import Outcome, RedisBatch
from storage.tenant_limits import Budget

logger = logging.getLogger(__name__)

# A reservation outlives the longest window; a job not settled by then (cancelled while
# queued, lost) simply keeps its estimate counted.
RESERVATION_TTL_S = 2 * 86_400
# A per-minute budget's bucket holds this many seconds of its refill: the burst a tenant
# may take at once. Small, so that no minute of usage holds much more than the budget.
BURST_S = 1.0

# KEYS: each budget's key base. ARGV: per budget (limit, window_s, kind: "b" a bucket
# refilled continuously, "w" a fixed window); the bucket's burst in seconds of refill; the
# reservation prefix and TTL; then per job (job id, estimated tokens). Admits jobs in
# order while all fit. Returns {num_granted, "<seconds until the blocking budget has
# room>", blocking budget's 1-based index (0: none)}. A reservation is stored as
# "<estimate> b:<key> w:<key> ...", what settling needs.
_RESERVE_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local n = #KEYS
local kinds, keys, limits, windows, level, cap, rate = {}, {}, {}, {}, {}, {}, {}
local burst_s = tonumber(ARGV[3 * n + 1])
for i = 1, n do
  limits[i] = tonumber(ARGV[3 * i - 2])
  windows[i] = tonumber(ARGV[3 * i - 1])
  kinds[i] = ARGV[3 * i]
  if kinds[i] == 'b' then
    keys[i] = KEYS[i]
    rate[i] = limits[i] / windows[i]
    cap[i] = math.max(1, rate[i] * burst_s)
    local state = redis.call('HMGET', keys[i], 'level', 'ts')
    local last = tonumber(state[1]) or cap[i]
    local ts = tonumber(state[2]) or now
    level[i] = math.min(cap[i], last + math.max(0, now - ts) * rate[i])
  else
    keys[i] = KEYS[i] .. ':' .. math.floor(now / windows[i])
    level[i] = tonumber(redis.call('GET', keys[i]) or '0')
  end
end
local reservation_prefix = ARGV[3 * n + 2]
local reservation_ttl = tonumber(ARGV[3 * n + 3])
local tagged = {}
for i = 1, n do tagged[i] = kinds[i] .. ':' .. keys[i] end
local all_keys = table.concat(tagged, ' ')
local granted, wait, blocking = 0, 0, 0
local j = 3 * n + 4
while j <= #ARGV do
  local job_id, estimate = ARGV[j], tonumber(ARGV[j + 1])
  for i = 1, n do
    local left = 0
    if kinds[i] == 'b' then
      if level[i] < estimate and level[i] < cap[i] then
        left = (math.min(estimate, cap[i]) - level[i]) / rate[i]
      end
    elseif level[i] > 0 and level[i] + estimate > limits[i] then
      left = (math.floor(now / windows[i]) + 1) * windows[i] - now
    end
    if left > wait then wait, blocking = left, i end
  end
  if blocking > 0 then break end
  for i = 1, n do
    if kinds[i] == 'b' then
      level[i] = level[i] - estimate
    else
      level[i] = level[i] + estimate
      redis.call('INCRBY', keys[i], estimate)
      redis.call('EXPIRE', keys[i], 2 * windows[i])
    end
  end
  redis.call('SET', reservation_prefix .. job_id, estimate .. ' ' .. all_keys,
             'EX', reservation_ttl)
  granted = granted + 1
  j = j + 2
end
for i = 1, n do
  if kinds[i] == 'b' then
    redis.call('HSET', keys[i], 'level', tostring(level[i]), 'ts', tostring(now))
    redis.call('EXPIRE', keys[i], 2 * windows[i])
  end
end
return {granted, tostring(wait), blocking}
"""

# ARGV: the reservation prefix, then per job (job id, tokens used). Moves each reserved
# job's budgets by (used - estimate) while they live: a bucket's level down, a window's
# count up. Jobs without a reservation are skipped. Returns how many were settled.
_SETTLE_LUA = """
local prefix = ARGV[1]
local settled = 0
local j = 2
while j <= #ARGV do
  local key = prefix .. ARGV[j]
  local reservation = redis.call('GET', key)
  if reservation then
    local estimate = nil
    local delta = 0
    for word in string.gmatch(reservation, '%S+') do
      if estimate == nil then
        estimate = tonumber(word)
        delta = tonumber(ARGV[j + 1]) - estimate
      elseif delta ~= 0 then
        local kind, budget_key = string.sub(word, 1, 1), string.sub(word, 3)
        if redis.call('EXISTS', budget_key) == 1 then
          if kind == 'b' then
            redis.call('HINCRBYFLOAT', budget_key, 'level', -delta)
          else
            redis.call('INCRBY', budget_key, delta)
          end
        end
      end
    end
    redis.call('DEL', key)
    settled = settled + 1
  end
  j = j + 2
end
return settled
"""


@dataclass(frozen=True, slots=True)
class Verdict:
    """How many of the asked jobs were admitted; for the rest, how long until the budget
    that stopped them refills, and which one."""

    num_granted: int
    retry_after_s: float
    blocking: Budget | None


class TokenBudgets:
    """Reserve and settle tokens against budgets in one Redis (sync or asyncio client)."""

    def __init__(self, redis_client: Any, *, prefix: str) -> None:
        self._prefix = prefix
        self._redis = redis_client
        self._reserve = redis_client.register_script(_RESERVE_LUA)
        self._settle = redis_client.register_script(_SETTLE_LUA)

    def _reserve_call(self, tenant_id: str, budgets: Sequence[Budget],
                      jobs: Sequence[tuple[str, int]]) -> tuple[list[str], list[Any]]:
        keys = [self.counter_base(tenant_id, b) for b in budgets]
        args: list[Any] = []
        for budget in budgets:
            args += [budget.limit, budget.window_s, "b" if budget.is_rate else "w"]
        args += [BURST_S, self.reservation_prefix, RESERVATION_TTL_S]
        for job_id, estimate in jobs:
            args += [job_id, max(1, int(estimate))]
        return keys, args

    def counter_base(self, tenant_id: str, budget: Budget) -> str:
        """The Redis key (without the window index) counting this budget's tokens."""
        return f"{self._prefix}:budget:{tenant_id}:{budget.model}:{budget.window_s}"

    @property
    def reservation_prefix(self) -> str:
        """Key prefix of the per-job reservations."""
        return f"{self._prefix}:budget:job:"

    def reserve(self, *, tenant_id: str, budgets: Sequence[Budget],
                jobs: Sequence[tuple[str, int]]) -> Verdict:
        """Admit the first jobs (job id, estimated tokens) that fit every budget."""
        if not budgets or not jobs:
            return Verdict(len(jobs), 0.0, None)
        keys, args = self._reserve_call(tenant_id, budgets, jobs)
        return _verdict(self._reserve(keys=keys, args=args), budgets)

    async def reserve_async(self, *, tenant_id: str, budgets: Sequence[Budget],
                            jobs: Sequence[tuple[str, int]]) -> Verdict:
        """`reserve` on an asyncio Redis client."""
        if not budgets or not jobs:
            return Verdict(len(jobs), 0.0, None)
        keys, args = self._reserve_call(tenant_id, budgets, jobs)
        return _verdict(await self._reserve(keys=keys, args=args), budgets)

    def settle(self, used: Sequence[tuple[str, int]]) -> int:
        """Replace reserved estimates with the tokens jobs used (job id, tokens); how many
        jobs had a reservation. A Redis error is logged: the estimate then stands."""
        if not used:
            return 0
        try:
            return int(self._settle(keys=[], args=self._settle_args(used)))
        except redis.RedisError as e:
            _settle_failed(len(used), e)
            return 0

    def queue_settle(self, batch: RedisBatch, used: Sequence[tuple[str, int]]) -> None:
        """`settle` sent with the other writes of `batch` (a sync client's); the script
        runs atomically as `settle`'s call does, and a failure is logged the same way."""
        if not used:
            return
        args = self._settle_args(used)

        def done(outcome: Outcome) -> None:
            if isinstance(outcome, redis.RedisError):
                _settle_failed(len(used), outcome)

        batch.add(lambda pipe: self._settle(keys=[], args=args, client=pipe), done)

    def _settle_args(self, used: Sequence[tuple[str, int]]) -> list[Any]:
        args: list[Any] = [self.reservation_prefix]
        for job_id, tokens in used:
            args += [job_id, max(0, int(tokens))]
        return args

    def used(self, *, tenant_id: str, budget: Budget, at: float) -> int:
        """Tokens counted now against a fixed-window (per day) budget in the window
        holding Unix time `at`."""
        assert not budget.is_rate, "a per-minute budget is a bucket, not a count"
        raw = self._redis.get(
            f"{self.counter_base(tenant_id, budget)}:{math.floor(at / budget.window_s)}")
        return int(raw or 0)


def _settle_failed(num_jobs: int, error: redis.RedisError) -> None:
    logger.warning("settling %d job(s)' token usage failed: %s", num_jobs, error)


def _verdict(reply: Sequence[Any], budgets: Sequence[Budget]) -> Verdict:
    granted, wait, blocking = reply
    index = int(blocking)
    return Verdict(int(granted), float(wait), budgets[index - 1] if index else None)


def estimate_tokens(body: dict[str, Any], *, default_completion_tokens: int) -> int:
    """Tokens a job will likely use, before it runs: its prompt at ~4 characters a token,
    plus its `max_tokens` (or the default expected output) for each of its `n` choices.
    Settling corrects it."""
    if "messages" in body:
        chars = sum(len(str(m.get("content") or "")) for m in body["messages"]
                    if isinstance(m, dict))
    else:
        prompt = body.get("prompt", body.get("input", ""))
        chars = len(prompt) if isinstance(prompt, str) else len(str(prompt))
    completion = body.get("max_tokens") or body.get("max_completion_tokens") \
        or body.get("max_output_tokens")
    if not isinstance(completion, int) or completion <= 0:
        completion = default_completion_tokens
    choices = body.get("n")
    if not isinstance(choices, int) or isinstance(choices, bool) or choices < 1:
        choices = 1
    return math.ceil(chars / 4) + completion * choices
