"""Sending streamed jobs' text to Redis off the engine thread.

Responsible for: taking the entries the engine loop hands over after each step (a queue
put, nothing more, so a slow Redis never slows a step), and writing everything waiting
in one pipelined round trip (`storage.token_streams.publish_entries`): one per step when
Redis keeps up, fewer, larger ones when it does not. Entries are in step order, and one
thread writes them, so a job's entries reach its stream in order.

A write that fails is dropped and logged once per outage: followers then miss deltas,
notice the gap by its offsets and end with the stored result, which has the whole text.
"""

from __future__ import annotations

import logging
import queue
import threading

import redis

from storage.token_streams import StreamEntry, publish_entries

logger = logging.getLogger(__name__)

# Seconds `stop` waits for the last writes.
STOP_TIMEOUT_S = 5.0


class TokenPublisher:
    """Writes token stream entries from its own thread (see the module docstring)."""

    def __init__(self, redis_client: redis.Redis, *, prefix: str, max_entries: int,
                 ttl_s: int) -> None:
        self._redis = redis_client
        self._prefix = prefix
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self._queue: queue.SimpleQueue[list[StreamEntry] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="token-publisher", daemon=True)
        self._is_failing = False

    def start(self) -> None:
        """Start the writing thread."""
        self._thread.start()

    def put(self, entries: list[StreamEntry]) -> None:
        """Queue a step's entries (from the engine thread; never blocks)."""
        self._queue.put(entries)

    def stop(self) -> None:
        """Write what is queued, then end the thread."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(STOP_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            entries = list(batch)
            is_stopping = False
            while True:  # everything queued meanwhile goes in the same round trip
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    is_stopping = True
                    break
                entries.extend(more)
            self._write(entries)
            if is_stopping:
                return

    def _write(self, entries: list[StreamEntry]) -> None:
        try:
            publish_entries(self._redis, entries, prefix=self._prefix,
                            max_entries=self._max_entries, ttl_s=self._ttl_s)
        except redis.RedisError as e:
            if not self._is_failing:
                logger.warning("cannot write streamed tokens to Redis (%s); followers get "
                               "the stored results instead", e)
            self._is_failing = True
            return
        if self._is_failing:
            logger.info("writing streamed tokens to Redis again")
            self._is_failing = False
