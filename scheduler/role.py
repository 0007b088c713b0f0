"""The scheduler role: the loops that read the database and write to Kafka.

Responsible for: building the clients the loops share (one database engine, one Kafka
producer, one Redis client, the file store), the start-up pass, running the reconciler,
the batch loop and the expired-file reaper on threads, and closing everything in reverse
order.
`batchinfer reconcile` runs it alone; `batchinfer up` runs it inside the embedded service.
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import ExitStack
from datetime import datetime

from core.settings import Settings

logger = logging.getLogger(__name__)

# Seconds each loop thread gets to finish its pass at shutdown.
JOIN_TIMEOUT_S = 30.0


class SchedulerRole:
    """Reconciler, batch loop (and its wake listener) and expired-file reaper threads over
    shared clients."""

    def __init__(self, settings: Settings) -> None:
        import redis

        from core.kafka import ensure_topics, make_producer
        from scheduler.batch_wake import BatchWakeListener
        from scheduler.batches import BatchRunner
        from scheduler.file_expiry import FileReaper
        from scheduler.periodic import Wakeup
        from scheduler.reconciler import Reconciler
        from storage.db import create_db_engine, session_factory
        from storage.files import FileStore

        self.settings = settings
        self._stack = ExitStack()
        try:
            ensure_topics(settings)
            engine = create_db_engine(settings.database_url)
            self._stack.callback(engine.dispose)
            producer = make_producer(settings)
            self._stack.callback(producer.close)
            redis_client = redis.Redis.from_url(settings.redis_url)
            self._stack.callback(redis_client.close)
            sessions = session_factory(engine)
            store = FileStore.from_settings(settings)
            self.reconciler = Reconciler(settings, sessions, producer,
                                         redis_client=redis_client)
            self.batches = BatchRunner(settings, sessions, producer, redis_client, store,
                                       wakeup=Wakeup())
            self.batch_wake = BatchWakeListener(redis_client, prefix=settings.topic_prefix,
                                                wakeup=self.batches.wakeup)
            # Expiry is hour-grained and the API hides expired files at once, so the
            # reconciler's pace is plenty.
            self.file_reaper = FileReaper(sessions, store,
                                          interval_s=self.reconciler.interval_s)
        except BaseException:
            self._stack.close()
            raise
        self._threads: list[threading.Thread] = []

    def run_once(self, *, republish_older_than: datetime | None = None) -> int:
        """One pass of each loop; returns the jobs re-published."""
        num_republished = self.reconciler.republish_stale(older_than=republish_older_than)
        self.batches.step()
        self.file_reaper.step()
        return num_republished

    def start(self, stop: threading.Event) -> None:
        """Run the loops on daemon threads until stop is set."""
        from scheduler.periodic import Periodic

        # The reconciler's and the reaper's first passes are the caller's run_once.
        loops = [
            Periodic(self.reconciler.republish_stale, self.reconciler.interval_s,
                     "reconciler", at_once=False),
            Periodic(self.batches.step, self.settings.batch_poll_interval_s, "batches",
                     wakeup=self.batches.wakeup),
            Periodic(self.file_reaper.step, self.file_reaper.interval_s, "file-expiry",
                     at_once=False),
        ]  # fmt: skip
        self._threads = [loop.start(stop) for loop in loops]
        self._threads.append(self.batch_wake.start(stop))
        logger.info("reconciling every %.0fs, batches every %.1fs", self.reconciler.interval_s,
                    self.settings.batch_poll_interval_s)

    def close(self) -> None:
        """Wait for the loop threads (stop must be set), then close the clients."""
        for thread in self._threads:
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                logger.warning("%s thread still busy after %.0fs", thread.name, JOIN_TIMEOUT_S)
        self._threads = []
        self._stack.close()


def run_scheduler(settings: Settings, *, once: bool = False) -> int:
    """`batchinfer reconcile`: one pass, or the loops until SIGTERM/SIGINT; exit code."""
    if settings.scheduler_metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.scheduler_metrics_port)
        logger.info("scheduler metrics on :%d/metrics", settings.scheduler_metrics_port)
    stop = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: stop.set())
    role = SchedulerRole(settings)
    try:
        role.run_once()
        if not once:
            role.start(stop)
            stop.wait()
    finally:
        stop.set()
        role.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
