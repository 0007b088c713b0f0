"""Exact-result cache in Redis for deterministic requests.

Responsible for: deciding which requests may be cached (temperature 0, or a seed), the
cache key (a hash of the model and the canonical form of the fields that can change the
output), reading and writing results, and keeping the cache's ledger (bytes held,
entries evicted: `storage.cache_ledger`) in the same round trip as its writes. A cache
is an optimisation: Redis errors are logged and read as a miss, never raised.

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
from typing import Any, cast

import orjson
import redis

from core import metrics
from core.greedy import GREEDY_TEMPERATURE
from storage.cache_ledger import CacheLedger, LedgerChange
from storage.db import ORJSON_OPTIONS, stdlib_json_default
from storage.redis_batch import Outcome, RedisBatch

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
        "background",
        "instructions",  # a response's echo of them: they run as its first message
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
    """True when the request's output is fixed: greedy (temperature 0, or below the engine's
    GREEDY_TEMPERATURE), or an explicit seed."""
    temperature = body.get("temperature")
    seed = body.get("seed")
    is_greedy = _is_greedy(temperature)
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
    if _is_greedy(canonical.get("temperature")):
        canonical["temperature"] = 0  # the engine decodes them all greedily
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


def _payload(value: dict[str, Any]) -> bytes:
    """A result as the JSON bytes an entry holds: orjson's (a third of the standard
    library's time per result on the worker's thread), or, for text UTF-8 cannot carry (a
    lone surrogate a free-form field kept), the standard library's with it as is."""
    try:
        return orjson.dumps(value, option=ORJSON_OPTIONS)
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False,
                          default=stdlib_json_default).encode("utf-8", "surrogatepass")


class ResultCache:
    """Finished results by `result_cache_key`, as JSON in Redis under `<prefix>:result:`."""

    KIND = "exact"

    def __init__(self, redis_client: redis.Redis, *, prefix: str) -> None:
        self._redis = redis_client
        self._prefix = prefix
        self.ledger = CacheLedger(redis_client, prefix=prefix, kind=self.KIND)

    def redis_key(self, key: str) -> str:
        """The Redis key holding the entry for a cache key."""
        return f"{self._prefix}:result:{key}"

    def get(self, key: str | None) -> dict[str, Any] | None:
        """The cached result, or None on a miss, a None key, or Redis trouble."""
        return self.get_many([key])[0]

    def get_many(self, keys: list[str | None]) -> list[dict[str, Any] | None]:
        """`get` for each key in one round trip (MGET); misses and None keys give None."""
        wanted = [key for key in keys if key is not None]
        if not wanted:
            return [None] * len(keys)
        try:
            raws = self._redis.mget([self.redis_key(key) for key in wanted])
        except redis.RedisError as e:
            metrics.CACHE_ERRORS.labels(self.KIND).inc()
            logger.warning("result cache read failed (%s); treating as misses", e)
            return [None] * len(keys)
        # A client without decode_responses (ours) answers bytes.
        found = cast(dict[str, bytes | None], dict(zip(wanted, raws, strict=True)))
        values = [None if key is None else _decoded(key, found[key]) for key in keys]
        loaded = sum(len(found[key] or b"") for key, value in zip(keys, values, strict=True)
                     if key is not None and value is not None)
        metrics.CACHE_BYTES.labels(self.KIND, "loaded").inc(loaded)
        return values

    def put_many(self, entries: list[tuple[str | None, dict[str, Any], int]]) -> None:
        """`put` for each (key, result, ttl) in one round trip (a pipeline, with the ledger)."""
        batch = RedisBatch(self._redis)
        self.queue_puts(batch, entries)
        batch.execute()

    def queue_puts(self, batch: RedisBatch,
                   entries: list[tuple[str | None, dict[str, Any], int]]) -> None:
        """`put_many`'s writes added to `batch`: sent, and their outcome counted, when it
        executes (a failure is logged and counted there, as `put_many`'s is)."""
        if any(ttl < 0 for _, _, ttl in entries):
            raise ValueError("ttl must be >= 0 seconds (0 disables caching)")
        payloads = {key: (_payload(value), ttl)
                    for key, value, ttl in entries if key is not None and ttl}
        if not payloads:
            return

        def queue(pipe: redis.client.Pipeline) -> None:
            for key, (payload, ttl) in payloads.items():
                pipe.set(self.redis_key(key), payload, ex=ttl)
            self.ledger.queue(pipe, [LedgerChange("set", key, len(payload), 1, ttl)
                                     for key, (payload, ttl) in payloads.items()])

        def done(outcome: Outcome) -> None:
            if isinstance(outcome, redis.RedisError):
                metrics.CACHE_ERRORS.labels(self.KIND).inc()
                logger.warning("result cache write failed (%s); %d results not cached",
                               outcome, len(payloads))
                return
            metrics.CACHE_BYTES.labels(self.KIND, "stored").inc(
                sum(len(payload) for payload, _ in payloads.values()))
            report = self.ledger.report(outcome[-1])
            metrics.CACHE_EVICTIONS.labels(self.KIND).inc(report.num_evicted)
            metrics.CACHE_RESIDENT_BYTES.labels(self.KIND).set(report.resident_bytes)

        batch.add(queue, done)

    def put(self, key: str | None, value: dict[str, Any], ttl: int) -> None:
        """Store a result for `ttl` seconds; nothing for a None key or a ttl of 0."""
        if ttl < 0:
            raise ValueError(f"ttl must be >= 0 seconds (0 disables caching), got {ttl}")
        self.put_many([(key, value, ttl)])


def _decoded(key: str, raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw.decode("utf-8", "surrogatepass") if isinstance(raw, bytes)
                           else raw)
    except ValueError:  # UnicodeDecodeError included
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


def _is_greedy(temperature: Any) -> bool:
    """A temperature the engine decodes greedily (0 included)."""
    return _is_number(temperature) and cast(float, temperature) < GREEDY_TEMPERATURE


def _is_number(value: Any) -> bool:
    """int or float, but not bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)
