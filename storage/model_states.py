"""Served models' states in Redis: which have a worker taking jobs, which cannot load.

Responsible for the three facts workers write and the API, `/readyz` and `up` read:
- live workers per model: the sorted set `<prefix>:model_workers:<name>`, member the worker
  id, score the Unix time of its last beat; a worker enters it once it consumes (its first
  poll with partitions assigned), beats it every heartbeat interval and leaves it when it
  stops, so a member older than the heartbeat timeout is a worker that died;
- load failures per model: the hash `<prefix>:model_failures`, name to the count of
  consecutive failed loads (HINCRBY, so replicas failing at once all count), and
  `<prefix>:model_errors`, name to the last load's error text;
- a load that succeeds clears both: one good worker proves the model loads.

A model's state follows from them (`model_state`): `ready` with a live worker, else
`failed` after MAX_LOAD_FAILURES failed loads in a row (new jobs for it are refused; those
already queued wait for a worker that can load it), else `loading`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import redis
from redis import asyncio as aioredis

# Failed loads in a row after which a model counts as failed: one failure can be a passing
# fault (memory taken by a neighbour), the same one three times is the model.
MAX_LOAD_FAILURES = 3


class ModelState(StrEnum):
    """Where a served model stands, as `GET /v1/models` shows it."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model's state, its live workers, and the error of its last failed load."""

    state: ModelState
    num_live_workers: int
    error: str | None = None

    def to_json(self) -> str:
        """The status as one JSON object."""
        return json.dumps(asdict(self))


def workers_key(prefix: str, name: str) -> str:
    """The sorted set of the workers consuming for model `name`."""
    return f"{prefix}:model_workers:{name}"


def failures_key(prefix: str) -> str:
    """The hash of consecutive failed loads per model."""
    return f"{prefix}:model_failures"


def errors_key(prefix: str) -> str:
    """The hash of the last load error per model."""
    return f"{prefix}:model_errors"


def beat_worker(client: redis.Redis, *, prefix: str, name: str, worker_id: str,
                now: float | None = None) -> None:
    """Count `worker_id` as consuming for `name` as of now."""
    client.zadd(workers_key(prefix, name), {worker_id: time.time() if now is None else now})


def remove_worker(client: redis.Redis, *, prefix: str, name: str, worker_id: str) -> None:
    """The worker stopped consuming for `name`."""
    client.zrem(workers_key(prefix, name), worker_id)


def record_load_failure(client: redis.Redis, *, prefix: str, name: str, error: str) -> int:
    """Count one failed load of `name` with its error; the failures in a row so far."""
    with client.pipeline() as pipe:
        pipe.hincrby(failures_key(prefix), name, 1)
        pipe.hset(errors_key(prefix), name, error)
        count, _ = pipe.execute()
    return int(count)


def record_load_success(client: redis.Redis, *, prefix: str, name: str) -> None:
    """`name` loaded: forget its failures (a new deployment, or a fault that passed)."""
    with client.pipeline() as pipe:
        pipe.hdel(failures_key(prefix), name)
        pipe.hdel(errors_key(prefix), name)
        pipe.execute()


def reset_models(client: redis.Redis, *, prefix: str, names: list[str]) -> None:
    """Forget the failures of `names` (a start that has just checked them loads afresh)."""
    if names:
        with client.pipeline() as pipe:
            pipe.hdel(failures_key(prefix), *names)
            pipe.hdel(errors_key(prefix), *names)
            pipe.execute()


def model_status(num_live_workers: int, failures: Any, error: Any) -> ModelStatus:
    """The status from the raw Redis answers (counts and text may come back as bytes)."""
    if num_live_workers > 0:
        return ModelStatus(ModelState.READY, num_live_workers)
    text = error.decode() if isinstance(error, bytes) else error
    if failures is not None and int(failures) >= MAX_LOAD_FAILURES:
        return ModelStatus(ModelState.FAILED, 0, text)
    return ModelStatus(ModelState.LOADING, 0, text)


def read_statuses(client: redis.Redis, *, prefix: str, names: list[str],
                  live_after_s: float, now: float | None = None) -> dict[str, ModelStatus]:
    """Name → status for every model in `names` (one round trip)."""
    since = (time.time() if now is None else now) - live_after_s
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.zcount(workers_key(prefix, name), since, "+inf")
        pipe.hgetall(failures_key(prefix))
        pipe.hgetall(errors_key(prefix))
        *counts, failures, errors = pipe.execute()
    return _statuses(names, counts, failures, errors)


async def aread_statuses(client: aioredis.Redis, *, prefix: str, names: list[str],
                         live_after_s: float) -> dict[str, ModelStatus]:
    """`read_statuses` on the asyncio client."""
    since = time.time() - live_after_s
    async with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.zcount(workers_key(prefix, name), since, "+inf")
        pipe.hgetall(failures_key(prefix))
        pipe.hgetall(errors_key(prefix))
        *counts, failures, errors = await pipe.execute()
    return _statuses(names, counts, failures, errors)


def _statuses(names: list[str], counts: list[Any], failures: dict[Any, Any],
              errors: dict[Any, Any]) -> dict[str, ModelStatus]:
    def of(raw: dict[Any, Any], name: str) -> Any:
        return raw.get(name.encode(), raw.get(name))

    return {name: model_status(int(count), of(failures, name), of(errors, name))
            for name, count in zip(names, counts, strict=True)}
