"""The autoscaler's second input: workers that queued deadlines need, not only the lag.

Lag says how much is queued, not by when it is due: 2,000 jobs due in a week need no more
workers, 200 due in five minutes may. Each reading takes the model's load (its queued
jobs in the order workers take them, its measured pace per worker; see
`storage.queue_estimates`) and returns the workers at whose pace every queued deadline
is met; the autoscaler runs at least that many (within its limits).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import sqlalchemy

from core import metrics
from core.settings import Settings
from storage.db import create_db_engine
from storage.estimates import read_loads
from storage.models import utcnow
from storage.queue_estimates import ModelQueue, workers_for_deadlines

logger = logging.getLogger(__name__)


class DeadlineFloor:
    """Reads one model's load and answers the workers its queued deadlines need."""

    def __init__(self, settings: Settings, *, model: str) -> None:
        self.settings = settings
        self.model = model
        self._engine: sqlalchemy.Engine | None = None

    def __call__(self) -> int:
        """Workers needed now; raises what the database raises."""
        if self._engine is None:
            self._engine = create_db_engine(self.settings.database_url)
        dead_before = utcnow() - timedelta(seconds=self.settings.worker_heartbeat_timeout_s)
        with self._engine.connect() as connection:
            reading = read_loads(connection, dead_before=dead_before).get(self.model)
        if reading is None:
            return 0
        now = time.time()
        queue = ModelQueue.of(reading, now)
        num_workers = workers_for_deadlines(queue, now=now)
        # What the dashboard shows beside the workers: the horizon of the ETAs.
        metrics.ESTIMATED_DRAIN_SECONDS.labels(self.model).set(queue.seconds_to_drain() or 0.0)
        metrics.SERVICE_TOKENS_PER_SECOND.labels(self.model).set(queue.tokens_per_s or 0.0)
        metrics.DEADLINE_WORKERS.labels(self.model).set(num_workers)
        return num_workers

    def close(self) -> None:
        """Release the database connections."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
