"""Queue positions and finish-time estimates for jobs and batches.

Responsible for:
- reading every model's load (`storage.estimates.read_loads`) at most once per
  `estimate_refresh_s`, whatever the number of readers: the long-poll path is hot, so a
  job's estimate is a few bisections in the last reading, never a query of its own;
- ordering each model's queued jobs as workers take them: priority, then deadline
  (earliest first, none last), then creation;
- the arithmetic. A queued job's work ahead is the jobs before it in that order plus
  half of the running ones' (on average half done), each worth the model's expected work
  (prompt tokens the engine computes plus output tokens, learned from finished jobs; a
  share answered from caches costs nothing). It finishes once that work and its own are
  done at the model's measured rate (tokens/s summed over its live workers), and not
  before its own output has been decoded one step at a time; it starts that long before.

Worked example: rate 1,000 tokens/s, expected work 200 tokens (150 out), step 20 ms,
2 running, job 9th in line: ahead = (8 + 2/2) x 200 = 1,800 tokens; completion = now +
(1,800 + 200) / 1,000 = now + 2.0 s (>= its own 150 x 0.02 = 3.0 s, so now + 3.0 s);
start = completion - 3.0 s = now.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import sqlalchemy

from core.topics import PRIORITIES
from storage.estimates import BatchTail, LoadReading, read_loads
from storage.models import utcnow

logger = logging.getLogger(__name__)

# Before a model has finished anything: what a job is assumed to be.
DEFAULT_PROMPT_TOKENS = 64.0
DEFAULT_COMPLETION_TOKENS = 128.0

QueueKey = tuple[float, float]  # (deadline or inf, created_at), seconds since the epoch


@dataclass(frozen=True, slots=True)
class Estimate:
    """Where a job stands: jobs ahead of it, and when it should start and finish."""

    queue_position: int | None
    estimated_start_at: float | None
    estimated_completion_at: float | None


@dataclass(slots=True)
class ModelQueue:
    """One model's reading, arranged for estimates."""

    at: float  # seconds since the epoch
    tokens_per_s: float | None
    step_s: float | None
    num_running: int
    work_per_job: float  # expected engine tokens of one queued job
    completion_tokens: float
    # Per priority rank: queued jobs' keys, sorted.
    queued: list[list[QueueKey]] = field(default_factory=list)

    @classmethod
    def of(cls, reading: LoadReading, at: float) -> ModelQueue:
        """Arrange a reading."""
        prompt = reading.mean_prompt_tokens
        completion = reading.mean_completion_tokens
        prompt = DEFAULT_PROMPT_TOKENS if prompt is None else prompt
        completion = DEFAULT_COMPLETION_TOKENS if completion is None else completion
        queued: list[list[QueueKey]] = [[] for _ in PRIORITIES]
        for priority, deadline, created_at in reading.queued:
            rank = PRIORITIES.index(priority) if priority in PRIORITIES else len(PRIORITIES) - 1
            queued[rank].append(queue_key(deadline, created_at))
        for keys in queued:
            keys.sort()
        return cls(
            at=at,
            tokens_per_s=reading.tokens_per_s,
            step_s=reading.step_s,
            num_running=len(reading.running_started),
            work_per_job=(prompt + completion) * (1 - reading.cache_hit_fraction),
            completion_tokens=completion,
            queued=queued,
        )

    def jobs_ahead(self, rank: int, key: QueueKey) -> int:
        """Queued jobs a job of this rank and key comes after."""
        more_urgent = sum(len(keys) for keys in self.queued[:rank])
        return more_urgent + bisect.bisect_left(self.queued[rank], key)

    @property
    def own_seconds(self) -> float:
        """How long one job runs once started: its output, one step per token."""
        return self.completion_tokens * (self.step_s or 0.0)

    def estimate_queued(self, rank: int, key: QueueKey, now: float) -> Estimate:
        """A queued job's (or a new one's) position and times."""
        ahead = self.jobs_ahead(rank, key)
        if not self.tokens_per_s:
            return Estimate(ahead, None, None)
        work = (ahead + self.num_running / 2 + 1) * self.work_per_job
        completion = max(now + work / self.tokens_per_s, now + self.own_seconds)
        start = max(now, completion - self.own_seconds)
        return Estimate(ahead, start, completion)

    def estimate_running(self, started_at: float, now: float) -> Estimate:
        """A running job's times: done its own run after it started (or a step from now)."""
        if not self.tokens_per_s:
            return Estimate(0, started_at, None)
        completion = max(started_at + self.own_seconds, now + (self.step_s or 0.0))
        return Estimate(0, started_at, completion)

    def seconds_to_drain(self) -> float | None:
        """How long the model's fleet needs for all the work it has now."""
        if not self.tokens_per_s:
            return None
        num_queued = sum(len(keys) for keys in self.queued)
        return (num_queued + self.num_running / 2) * self.work_per_job / self.tokens_per_s


def queue_key(deadline: datetime | None, created_at: datetime) -> QueueKey:
    """How workers order queued jobs within a priority: deadline, then creation."""
    return (deadline.timestamp() if deadline is not None else math.inf, created_at.timestamp())


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
    ) -> Estimate | None:
        """A queued or running job's estimate (None for any other status, or no data)."""
        if status not in ("queued", "running"):
            return None
        queue = self.model(model)
        if queue is None:
            return None
        now = time.time()
        if status == "running":
            return queue.estimate_running((started_at or created_at).timestamp(), now)
        rank = PRIORITIES.index(priority) if priority in PRIORITIES else len(PRIORITIES) - 1
        return queue.estimate_queued(rank, queue_key(deadline, created_at), now)

    def batch_completion(self, *, model: str, priority: str, tail: BatchTail) -> float | None:
        """When a batch's last unfinished job should finish (seconds since the epoch)."""
        queue = self.model(model)
        if queue is None:
            return None
        now = time.time()
        if tail.num_queued and tail.last_created_at is not None:
            rank = PRIORITIES.index(priority) if priority in PRIORITIES else len(PRIORITIES) - 1
            key = queue_key(tail.last_deadline, tail.last_created_at)
            return queue.estimate_queued(rank, key, now).estimated_completion_at
        if tail.num_running and tail.last_started_at is not None:
            return queue.estimate_running(tail.last_started_at.timestamp(), now)\
                .estimated_completion_at
        return None

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
