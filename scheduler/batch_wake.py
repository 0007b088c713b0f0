"""The batch loop's ear: Redis announcements of waiting batches bring its next pass forward.

Responsible for: holding a subscription to `batches_wake_channel` on a daemon thread and
setting the loop's `Wakeup` for every message, re-subscribing after Redis comes back.
Best effort by design: a lost announcement, or Redis being away, costs a batch at most one
`batch_poll_interval_s`, the pace the loop keeps anyway.
"""

from __future__ import annotations

import logging
import threading

import redis

from scheduler.periodic import Wakeup
from storage.events import batches_wake_channel

logger = logging.getLogger(__name__)

# Seconds a listener waits for a message before looking at its stop event again.
LISTEN_TIMEOUT_S = 0.5
# Seconds between attempts to subscribe while Redis is away.
RETRY_S = 5.0


class BatchWakeListener:
    """Sets `wakeup` whenever the API announces a created or cancelled batch."""

    def __init__(self, redis_client: redis.Redis, *, prefix: str, wakeup: Wakeup) -> None:
        self._redis = redis_client
        self._channel = batches_wake_channel(prefix)
        self._wakeup = wakeup

    def run(self, stop: threading.Event) -> None:
        """Listen on the calling thread until stop is set."""
        is_away = False
        while not stop.is_set():
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self._channel)
                if is_away:
                    logger.info("listening for batch announcements again")
                    # Whatever was announced meanwhile was missed: look now.
                    self._wakeup.set()
                    is_away = False
                while not stop.is_set():
                    if pubsub.get_message(timeout=LISTEN_TIMEOUT_S) is not None:
                        self._wakeup.set()
            except redis.RedisError as e:
                if not is_away:
                    logger.warning("batch announcements unavailable (%s); passes keep their "
                                   "interval until Redis is back", e)
                is_away = True
                stop.wait(RETRY_S)
            finally:
                pubsub.close()

    def start(self, stop: threading.Event) -> threading.Thread:
        """run(stop) on a started daemon thread."""
        thread = threading.Thread(target=self.run, args=(stop,), name="batch-wake",
                                  daemon=True)
        thread.start()
        return thread
