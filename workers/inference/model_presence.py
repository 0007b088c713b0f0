"""What a worker tells the others about its model: that it failed to load, or that it takes jobs.

Responsible for:
- `load_recorded`: the engine's load, with a failure counted against the model (and its
  error kept) and a success clearing them, so a model that never loads shows `failed` and
  its new jobs are refused instead of queueing behind a crash loop;
- `ModelPresence`: the worker's entry in its model's live set from its first consuming
  poll on, beaten every heartbeat interval on a daemon thread and removed when it stops.

Redis being away costs only these reports (the worker serves jobs all the same).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import redis

from core.settings import Settings
from storage.model_states import (
    beat_worker,
    record_load_failure,
    record_load_success,
    remove_worker,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


def load_recorded(settings: Settings, load: Callable[[], T]) -> T:
    """`load()`, its failure or success recorded against settings.served_model_name."""
    name, prefix = settings.served_model_name, settings.topic_prefix
    client = redis.Redis.from_url(settings.redis_url)
    try:
        try:
            loaded = load()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            try:
                count = record_load_failure(client, prefix=prefix, name=name, error=error)
                logger.error("model %s failed to load (%d time(s) in a row): %s", name, count,
                             error)
            except redis.RedisError as redis_error:
                logger.warning("cannot record the failed load of %s: %s", name, redis_error)
            raise
        try:
            record_load_success(client, prefix=prefix, name=name)
        except redis.RedisError as e:
            logger.warning("cannot record the load of %s: %s", name, e)
        return loaded
    finally:
        client.close()


class ModelPresence:
    """This worker in its model's live set while it consumes (see storage.model_states)."""

    def __init__(self, client: redis.Redis, *, prefix: str, name: str, worker_id: str,
                 interval_s: float) -> None:
        self._client = client
        self._prefix = prefix
        self._name = name
        self._worker_id = worker_id
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ModelPresence:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Count this worker as consuming from now on (idempotent)."""
        if self._thread is not None:
            return
        self._beat()
        logger.info("worker %s takes jobs for model %s", self._worker_id, self._name)
        self._thread = threading.Thread(target=self._run, name="model-presence", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Leave the live set: the model has one worker fewer."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(self._interval_s + 1.0)
        try:
            remove_worker(self._client, prefix=self._prefix, name=self._name,
                          worker_id=self._worker_id)
        except redis.RedisError as e:  # the entry ages out after the heartbeat timeout
            logger.warning("cannot remove %s from model %s's workers: %s", self._worker_id,
                           self._name, e)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._beat()

    def _beat(self) -> None:
        try:
            beat_worker(self._client, prefix=self._prefix, name=self._name,
                        worker_id=self._worker_id)
        except redis.RedisError as e:
            logger.warning("cannot beat %s for model %s: %s", self._worker_id, self._name, e)
