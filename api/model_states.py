"""The served models' states as the API sees them: read from Redis at most once a second.

Every submission asks whether its model failed to load; a second's staleness costs a
failed model a second of accepted jobs (they wait queued, nothing is lost) and saves a
Redis round trip per request. Redis being away answers "unknown": jobs are then accepted,
as they were before a state existed.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis
from redis import asyncio as aioredis

from api.errors import SERVER_ERROR, APIError
from core.settings import Settings
from storage.model_states import ModelState, ModelStatus, aread_statuses, read_statuses

logger = logging.getLogger(__name__)

# Seconds a reading of every model's state is reused.
MAX_AGE_S = 1.0
# Seconds a client should wait before submitting to a failed model again.
RETRY_AFTER_S = 30


class ModelUnavailable(APIError):
    """503: the model failed to load on every try; new jobs for it are refused."""

    status_code = 503
    type = SERVER_ERROR
    code = "model_unavailable"

    def __init__(self, model: str, error: str | None) -> None:
        super().__init__(
            f"Model {model!r} failed to load and takes no new jobs: {error or 'unknown error'}. "
            "Jobs already queued for it wait for a worker that loads it.",
            param="model", headers={"Retry-After": str(RETRY_AFTER_S)})


def refuse_if_failed(client: redis.Redis, settings: Settings, model: str) -> None:
    """ModelUnavailable when `model` failed to load (a fresh read, for routes off the hot
    path: a batch created for one model); nothing when Redis does not answer."""
    try:
        status = read_statuses(client, prefix=settings.topic_prefix, names=[model],
                               live_after_s=settings.worker_heartbeat_timeout_s)[model]
    except redis.RedisError as e:
        logger.warning("cannot read the state of model %s from Redis: %s", model, e)
        return
    if status.state is ModelState.FAILED:
        raise ModelUnavailable(model, status.error)


class ModelStateReader:
    """Statuses of the served models, re-read at most every MAX_AGE_S."""

    def __init__(self, client: aioredis.Redis, *, prefix: str, names: list[str],
                 live_after_s: float) -> None:
        self._client = client
        self._prefix = prefix
        self._names = names
        self._live_after_s = live_after_s
        self._statuses: dict[str, ModelStatus] = {}
        self._read_at: float | None = None
        self._lock = asyncio.Lock()

    async def read(self, *, fresh: bool = False) -> dict[str, ModelStatus]:
        """Name → status; {} when Redis does not answer. `fresh` skips the reuse."""
        if not fresh and self._is_recent():
            return self._statuses
        async with self._lock:
            if not fresh and self._is_recent():
                return self._statuses  # another request read it while this one waited
            try:
                self._statuses = await aread_statuses(
                    self._client, prefix=self._prefix, names=self._names,
                    live_after_s=self._live_after_s)
            except redis.RedisError as e:
                logger.warning("cannot read the models' states from Redis: %s", e)
                self._statuses = {}
            self._read_at = time.monotonic()
        return self._statuses

    async def refuse_if_failed(self, model: str) -> None:
        """Raise ModelUnavailable when `model` failed to load on every try."""
        status = (await self.read()).get(model)
        if status is not None and status.state is ModelState.FAILED:
            raise ModelUnavailable(model, status.error)

    def _is_recent(self) -> bool:
        return self._read_at is not None and time.monotonic() - self._read_at < MAX_AGE_S
