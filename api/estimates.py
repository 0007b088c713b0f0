"""Queue positions and finish-time estimates for jobs and batches.

Responsible for:
- reading every model's load (`storage.estimates.read_loads`) at most once per
  `estimate_refresh_s`, whatever the number of readers: the long-poll path is hot, so a
  job's estimate is a few bisections in the last reading, never a query of its own;
- ordering each model's queued jobs as workers take them: priority, then deadline
  (earliest first, none last), then creation;
- the arithmetic, in `storage.queue_estimates` (shared with the autoscaler).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import sqlalchemy

from core.topics import PRIORITIES
from storage.estimates import BatchLeft, read_loads
from storage.models import utcnow
from storage.queue_estimates import Estimate, ModelQueue, queue_key

logger = logging.getLogger(__name__)


class EstimateBoard:
    """The last reading of every model, refreshed at most every `refresh_s`."""

    def __init__(
        self, engine: sqlalchemy.Engine, *, refresh_s: float, heartbeat_timeout_s: float
    ) -> None:
        self._engine = engine
        self.refresh_s = refresh_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._lock = threading.Lock()
        self._queues: dict[str, ModelQueue] = {}
        self._read_at = -math.inf  # monotonic

    def model(self, model: str) -> ModelQueue | None:
        """The model's queue as last read (refreshed first if stale); None if unknown."""
        self._refresh_if_stale()
        return self._queues.get(model)

    def estimate(
        self,
        *,
        model: str,
        priority: str,
        status: str,
        created_at: datetime,
        deadline: datetime | None = None,
        started_at: datetime | None = None,
        max_tokens: int | None = None,
    ) -> Estimate | None:
        """A queued or running job's estimate (None for any other status, or no data)."""
        if status not in ("queued", "running"):
            return None
        queue = self.model(model)
        if queue is None:
            return None
        now = time.time()
        if status == "running":
            return queue.estimate_running((started_at or created_at).timestamp(), now,
                                          max_tokens)
        rank = PRIORITIES.index(priority) if priority in PRIORITIES else len(PRIORITIES) - 1
        return queue.estimate_queued(rank, queue_key(deadline, created_at), now, max_tokens)

    def batch_completion(self, *, model: str, priority: str, batch_id: str,
                         deadline: datetime | None, read_left: Callable[[], BatchLeft],
                         num_unqueued_ahead: int = 0,
                         budget_tokens_per_s: float | None = None) -> float | None:
        """When a batch's last unfinished job should finish (seconds since the epoch).

        The batch's jobs are placed as the last reading holds them (its queued and running
        jobs then): that reading is up to `refresh_s` old, and placing a fresher count in
        it put a batch just fanned out at the head of a queue that did not hold its lines
        yet, its estimate one job long (bench/eta_accuracy.py: -85% before any line was
        claimed). What it has left is counted once the reading is taken (`read_left`, in
        a transaction of its own: an older snapshot would count lines enqueued since it
        twice). Of its unfinished jobs, those the reading does not hold were queued since
        (as many as it grew by; when more finished since, the reading's age is taken off
        its running work by the pace); they and the lines that are not jobs yet (they
        wait for the fan-out's window or the tenant's token budget) come
        after the jobs it holds and the `num_unqueued_ahead` lines of nearer deadlines the
        window serves first, at the model's pace, and the unqueued ones no faster than the
        tenant's budget lets them (`budget_tokens_per_s`, the tightest of its budgets).
        """
        queue = self.model(model)
        if queue is None:
            return None
        left = read_left()
        num_unqueued = left.num_unqueued
        now = time.time()
        tail = queue.batch_tails.get(batch_id)
        at: float | None = None
        if tail is not None and tail.num_queued and tail.last_created_at is not None:
            rank = PRIORITIES.index(priority) if priority in PRIORITIES else len(PRIORITIES) - 1
            key = queue_key(tail.last_deadline, tail.last_created_at)
            at = queue.estimate_queued(rank, key, now).estimated_completion_at
        elif tail is not None and tail.num_running and tail.last_started_at is not None:
            at = queue.estimate_running(tail.last_started_at.timestamp(), now,
                                        is_last=True).estimated_completion_at
        num_unread = max(0, left.num_unfinished - (tail.num_unfinished if tail else 0))
        if not num_unqueued and not num_unread:
            return at
        if at is None and queue.tokens_per_s:
            # Nothing of it in the reading: its first job where one of its lines queued
            # now would stand, the others after that one.
            rank = PRIORITIES.index(priority) if priority in PRIORITIES else len(PRIORITIES) - 1
            key = queue_key(deadline, datetime.fromtimestamp(now, UTC))
            first = queue.estimate_queued(rank, key, now).estimated_completion_at
            if num_unread:
                num_unread -= 1
            else:
                num_unqueued -= 1
            at = first
        return queue.finish_unqueued(at, now, num_unqueued=num_unqueued, num_unread=num_unread,
                                     num_ahead=num_unqueued_ahead,
                                     budget_tokens_per_s=budget_tokens_per_s)

    def refresh(self) -> None:
        """Read every model's load now."""
        dead_before = utcnow() - timedelta(seconds=self.heartbeat_timeout_s)
        with self._engine.connect() as connection:
            readings = read_loads(connection, dead_before=dead_before)
        at = time.time()
        self._queues = {model: ModelQueue.of(r, at) for model, r in readings.items()}
        self._read_at = time.monotonic()

    def _refresh_if_stale(self) -> None:
        if time.monotonic() - self._read_at < self.refresh_s:
            return
        # One reader refreshes; the others answer from the reading they have meanwhile.
        if not self._lock.acquire(blocking=not self._queues):
            return
        try:
            if time.monotonic() - self._read_at >= self.refresh_s:
                self.refresh()
        except sqlalchemy.exc.SQLAlchemyError as e:
            logger.warning("cannot read the load for estimates: %s", e)
            self._read_at = time.monotonic()  # try again after refresh_s, not per request
        finally:
            self._lock.release()
