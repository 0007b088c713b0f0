"""Exact-result cache in Redis for deterministic requests.

Responsible for: deciding which requests may be cached (temperature 0, or a seed), the
cache key (a hash of the model and the canonical form of the fields that can change the
output), and reading and writing results. A cache is an optimisation: Redis errors are
logged and read as a miss, never raised.

Canonical form, worked through: `{"temperature": 0.0, "stop": "END", "top_p": 0.9,
"priority": "low", "max_completion_tokens": 8}` and `{"temperature": 0, "stop": ["END"],
"max_tokens": 8, "metadata": {"run": 2}}` both become `{"max_tokens": 8, "stop": ["END"],
"temperature": 0}` (greedy decoding ignores top_p; priority and metadata shape no token),
so they share a key.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import redis

logger = logging.getLogger(__name__)

# Bump when the canonical form or the stored result's shape changes: old entries then miss.
RESULT_CACHE_VERSION = 1
# Body fields that route, deliver or label a job but shape none of its tokens.
NON_SAMPLING_FIELDS = frozenset(
    {
        "model",
        "priority",
        "callback_url",
        "metadata",
        "user",
        "stream",
        "stream_options",
        "cache_key",
        "cache",
        "custom_id",
        "store",
        "service_tier",
    }
)
# Greedy decoding takes the argmax: these sampling knobs cannot change its output.
GREEDY_IRRELEVANT_FIELDS = frozenset({"seed", "top_p", "top_k", "min_p"})
# Fields given their default value are the same request as fields left out.
DEFAULT_VALUES: dict[str, Any] = {
    "n": 1,
    "logprobs": False,
    "echo": False,
    "top_p": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "ignore_eos": False,
}


def is_deterministic(body: dict[str, Any]) -> bool:
    """True when the request's output is fixed: temperature 0, or an explicit seed."""
    temperature = body.get("temperature")
    seed = body.get("seed")
    is_greedy = _is_number(temperature) and temperature == 0
    has_seed = isinstance(seed, int) and not isinstance(seed, bool)
    return is_greedy or has_seed


def canonical_request(body: dict[str, Any]) -> dict[str, Any]:
    """The output-shaping fields of a request body in one normal form (see module doc)."""
    canonical = {
        name: _canonical_value(value)
        for name, value in body.items()
        if name not in NON_SAMPLING_FIELDS and value is not None
    }
    if "max_tokens" not in canonical and "max_completion_tokens" in canonical:
        canonical["max_tokens"] = canonical.pop("max_completion_tokens")
    stop = canonical.pop("stop", None)
    if isinstance(stop, str):
        stop = [stop]
    if stop:
        # Which stop string matches first does not depend on their order; [] is no stop.
        canonical["stop"] = sorted(set(stop), key=str) if isinstance(stop, list) else stop
    if canonical.get("temperature") == 0:
        for name in GREEDY_IRRELEVANT_FIELDS:
            canonical.pop(name, None)
    for name, default in DEFAULT_VALUES.items():
        if name in canonical and canonical[name] == default:
            del canonical[name]
    return canonical


def result_cache_key(model: str, body: dict[str, Any], *, salt: str | None = None) -> str | None:
    """SHA-256 hex key of model + canonical body; None when the request is not deterministic.

    `salt` (e.g. a tenant id) keeps entries apart; without it equal requests share results.
    """
    if not is_deterministic(body):
        return None
    material = {
        "v": RESULT_CACHE_VERSION,
        "model": model,
        "salt": salt,
        "request": canonical_request(body),
    }
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class ResultCache:
    """Finished results by `result_cache_key`, as JSON in Redis under `<prefix>:result:`."""

    def __init__(self, redis_client: redis.Redis, *, prefix: str) -> None:
        self._redis = redis_client
        self._prefix = prefix

    def redis_key(self, key: str) -> str:
        """The Redis key holding the entry for a cache key."""
        return f"{self._prefix}:result:{key}"

    def get(self, key: str | None) -> dict[str, Any] | None:
        """The cached result, or None on a miss, a None key, or Redis trouble."""
        if key is None:
            return None
        try:
            raw = self._redis.get(self.redis_key(key))
        except redis.RedisError as e:
            logger.warning("result cache read failed (%s); treating as a miss", e)
            return None
        return _decoded(key, raw)

    def get_many(self, keys: list[str | None]) -> list[dict[str, Any] | None]:
        """`get` for each key in one round trip (MGET); misses and None keys give None."""
        wanted = [key for key in keys if key is not None]
        if not wanted:
            return [None] * len(keys)
        try:
            raws = self._redis.mget([self.redis_key(key) for key in wanted])
        except redis.RedisError as e:
            logger.warning("result cache read failed (%s); treating as misses", e)
            return [None] * len(keys)
        found = dict(zip(wanted, raws, strict=True))
        return [None if key is None else _decoded(key, found[key]) for key in keys]

    def put_many(self, entries: list[tuple[str | None, dict[str, Any], int]]) -> None:
        """`put` for each (key, result, ttl) in one round trip (a pipeline)."""
        if any(ttl < 0 for _, _, ttl in entries):
            raise ValueError("ttl must be >= 0 seconds (0 disables caching)")
        entries = [(key, value, ttl) for key, value, ttl in entries if key is not None and ttl]
        if not entries:
            return
        pipe = self._redis.pipeline(transaction=False)
        for key, value, ttl in entries:
            assert key is not None
            pipe.set(self.redis_key(key),
                     json.dumps(value, separators=(",", ":"), ensure_ascii=False), ex=ttl)
        try:
            pipe.execute()
        except redis.RedisError as e:
            logger.warning("result cache write failed (%s); %d results not cached", e,
                           len(entries))

    def put(self, key: str | None, value: dict[str, Any], ttl: int) -> None:
        """Store a result for `ttl` seconds; nothing for a None key or a ttl of 0."""
        if ttl < 0:
            raise ValueError(f"ttl must be >= 0 seconds (0 disables caching), got {ttl}")
        if key is None or ttl == 0:
            return
        payload = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        try:
            self._redis.set(self.redis_key(key), payload, ex=ttl)
        except redis.RedisError as e:
            logger.warning("result cache write failed (%s); result not cached", e)


def _decoded(key: str, raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        logger.warning("result cache entry %s is not JSON; ignoring it", key)
        return None
    return value if isinstance(value, dict) else None


def _canonical_value(value: Any) -> Any:
    """Integral floats as ints, None dropped from mappings, recursively."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical_value(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_canonical_value(v) for v in value]
    return value


def _is_number(value: Any) -> bool:
    """int or float, but not bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)
