"""What the estimates are computed from, read in a few grouped queries for every model.

Responsible for one `LoadReading` per served model: the measured pace of its live workers
and the work their engines have left (from their heartbeats), the jobs queued (with what
orders them) and running, and the work a job turned out to be (means over its recently
finished jobs, with the share answered from a cache, which costs the engine nothing). The
API reads this about once a second, not per request (see `api.estimates`).

Functions take a connection and never write.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import datetime

from sqlalchemy import Connection, func, select

from storage.batches import Batch, BatchStatus
from storage.models import Job, JobStatus, WorkerHeartbeat

# Finished jobs per model the work means are taken over.
RECENT_JOBS = 200


@dataclass(slots=True)
class WorkerWork:
    """What one live worker's engine had left when it last beat (see
    storage.models.WorkerHeartbeat), its pace then, and the jobs it claimed since (in no
    report yet)."""

    reported_at: datetime
    num_requests: int
    num_tokens_to_compute: int
    num_output_tokens: int
    tokens_per_s: float | None
    num_claimed_since: int = 0
    num_claimed_before: int = 0  # its running jobs claimed at or before the beat
    # When the first of the jobs claimed since the beat was claimed (None: none was).
    first_claimed_since: datetime | None = None

    @property
    def is_idle_at_beat(self) -> bool:
        """Whether the worker held nothing at its beat (its engine empty, nothing claimed):
        its pace then did nothing until it claimed a job."""
        return self.num_requests == 0 and self.num_claimed_before == 0


@dataclass(frozen=True, slots=True)
class BatchTail:
    """A batch's unfinished jobs, as its estimate needs them."""

    num_queued: int
    num_running: int
    # The queued job workers will take last (latest deadline, then creation).
    last_deadline: datetime | None
    last_created_at: datetime | None
    # The running job that started last.
    last_started_at: datetime | None

    @property
    def num_unfinished(self) -> int:
        """Its jobs queued or running."""
        return self.num_queued + self.num_running

    def with_job(self, *, is_queued: bool, deadline: datetime | None, created_at: datetime,
                 started_at: datetime) -> BatchTail:
        """This tail with one more queued (or running) job."""
        if not is_queued:
            last = self.last_started_at
            return replace(self, num_running=self.num_running + 1,
                           last_started_at=started_at if last is None or started_at > last
                           else last)
        # Workers take the latest deadline (none: last of all), then the latest created, last.
        is_last = self.last_created_at is None or _order(deadline, created_at) > _order(
            self.last_deadline, self.last_created_at)
        return replace(self, num_queued=self.num_queued + 1,
                       last_deadline=deadline if is_last else self.last_deadline,
                       last_created_at=created_at if is_last else self.last_created_at)


@dataclass(slots=True)
class LoadReading:
    """One model's load and pace, as read at one moment."""

    num_workers: int = 0
    tokens_per_s: float | None = None  # summed over its live workers
    step_s: float | None = None  # the mean over its live workers
    # A decode step of one sequence alone, the mean over the live workers that report it.
    solo_step_s: float | None = None
    # (priority, deadline or None, created_at) of each queued job.
    queued: list[tuple[str, datetime | None, datetime]] = field(default_factory=list)
    # started_at of each running job.
    running_started: list[datetime] = field(default_factory=list)
    mean_prompt_tokens: float | None = None  # the part the engine computed (not cached)
    mean_completion_tokens: float | None = None
    # Output tokens over the job's max_tokens, averaged over those that had one.
    mean_output_fill: float | None = None
    cache_hit_fraction: float = 0.0
    # One per live worker that reports the work its engine has left.
    work_left: list[WorkerWork] = field(default_factory=list)
    # Running jobs of workers that report no work left (a remote engine, an older worker,
    # a dead one).
    num_running_unreported: int = 0
    # Batch id -> its queued and running jobs in this reading: a batch's estimate places
    # them in this reading's queue, never a fresher count of its own (see api.estimates).
    batch_tails: dict[str, BatchTail] = field(default_factory=dict)
    # Lines of its batches in progress that are not jobs yet (the fan-out's window).
    num_unqueued_lines: int = 0


def read_loads(connection: Connection, *, dead_before: datetime) -> dict[str, LoadReading]:
    """A reading of every model with live workers or queued or running jobs."""
    loads: dict[str, LoadReading] = defaultdict(LoadReading)
    w = WorkerHeartbeat
    workers = connection.execute(
        select(w.id, w.model, w.tokens_per_s, w.step_s, w.heartbeat_at, w.num_requests_left,
               w.num_tokens_to_compute, w.num_output_tokens_left, w.solo_step_s)
        .where(w.heartbeat_at >= dead_before, w.model.is_not(None))
    )  # fmt: skip
    steps: dict[str, list[float]] = defaultdict(list)
    solo_steps: dict[str, list[float]] = defaultdict(list)
    reports: dict[str, WorkerWork] = {}
    for worker_id, model, tokens_per_s, step_s, beat_at, num_left, num_to_compute, num_output, \
            solo_step_s in workers:
        assert model is not None  # filtered above
        load = loads[model]
        load.num_workers += 1
        if tokens_per_s:
            load.tokens_per_s = (load.tokens_per_s or 0.0) + tokens_per_s
        if step_s:
            steps[model].append(step_s)
        if solo_step_s:
            solo_steps[model].append(solo_step_s)
        if num_left is not None and num_to_compute is not None and num_output is not None:
            reports[worker_id] = WorkerWork(beat_at, num_left, num_to_compute, num_output,
                                            tokens_per_s)
            load.work_left.append(reports[worker_id])
    for model, values in steps.items():
        loads[model].step_s = sum(values) / len(values)
    for model, values in solo_steps.items():
        loads[model].solo_step_s = sum(values) / len(values)
    active = connection.execute(
        select(Job.model, Job.status, Job.priority, Job.deadline, Job.created_at,
               Job.started_at, Job.worker_id, Job.batch_id)
        .where(Job.status.in_((JobStatus.QUEUED, JobStatus.RUNNING)))
    )  # fmt: skip
    for model, status, priority, deadline, created_at, started_at, owner, batch_id in active:
        load = loads[model]
        if batch_id is not None:
            tail = load.batch_tails.get(batch_id) or BatchTail(0, 0, None, None, None)
            load.batch_tails[batch_id] = tail.with_job(
                is_queued=status == JobStatus.QUEUED, deadline=deadline,
                created_at=created_at, started_at=started_at or created_at)
        if status == JobStatus.QUEUED:
            load.queued.append((priority, deadline, created_at))
            continue
        load.running_started.append(started_at or created_at)
        report = reports.get(owner) if owner is not None else None
        if report is None:
            load.num_running_unreported += 1
        elif started_at is not None and started_at > report.reported_at:
            report.num_claimed_since += 1
            if report.first_claimed_since is None or started_at < report.first_claimed_since:
                report.first_claimed_since = started_at
        else:
            report.num_claimed_before += 1
    unqueued = connection.execute(
        select(Batch.model, func.sum(Batch.num_requests - Batch.num_enqueued))
        .where(Batch.status == BatchStatus.IN_PROGRESS, Batch.model.is_not(None),
               Batch.num_enqueued < Batch.num_requests)
        .group_by(Batch.model)
    )  # fmt: skip
    for model, num_lines in unqueued:
        if model in loads:  # a model without workers or jobs has no estimates to make
            loads[model].num_unqueued_lines = int(num_lines or 0)
    for model, load in loads.items():
        _read_work(connection, model, load)
    return dict(loads)


def _read_work(connection: Connection, model: str, load: LoadReading) -> None:
    """Means over the model's last RECENT_JOBS succeeded jobs; a cache answer was never
    claimed (`attempts` 0)."""
    recent = (
        select(Job.prompt_tokens, Job.cached_tokens, Job.completion_tokens, Job.attempts,
               Job.request["max_tokens"].as_integer().label("max_tokens"))
        .where(Job.model == model, Job.status == JobStatus.SUCCEEDED,
               Job.finished_at.is_not(None))
        .order_by(Job.finished_at.desc())
        .limit(RECENT_JOBS)
        .subquery()
    )  # fmt: skip
    ran = recent.c.attempts > 0
    row = connection.execute(
        select(
            func.count(),
            func.count().filter(ran),
            func.avg(func.coalesce(recent.c.prompt_tokens, 0)
                     - func.coalesce(recent.c.cached_tokens, 0)).filter(ran),
            func.avg(recent.c.completion_tokens).filter(ran),
            func.avg(recent.c.completion_tokens * 1.0 / recent.c.max_tokens)
            .filter(ran, recent.c.max_tokens > 0),
        )
    ).one()  # fmt: skip
    num_finished, num_ran, mean_prompt, mean_completion, mean_fill = row
    if not num_finished:
        return
    load.cache_hit_fraction = 1 - num_ran / num_finished
    load.mean_prompt_tokens = None if mean_prompt is None else float(mean_prompt)
    load.mean_completion_tokens = None if mean_completion is None else float(mean_completion)
    load.mean_output_fill = None if mean_fill is None else float(mean_fill)


@dataclass(frozen=True, slots=True)
class BatchLeft:
    """What a batch has left, counted at one moment."""

    num_unqueued: int  # lines not yet jobs (the fan-out's cursor behind the file's end)
    num_unfinished: int  # its jobs queued or running


def read_batch_left(connection: Connection, *, batch_id: str) -> BatchLeft:
    """A batch's lines not yet enqueued and its unfinished jobs (ix_jobs_batch)."""
    num_unqueued = connection.execute(
        select(Batch.num_requests - Batch.num_enqueued).where(Batch.id == batch_id)
    ).scalar_one_or_none()  # fmt: skip
    num_unfinished = connection.execute(
        select(func.count())
        .where(Job.batch_id == batch_id,
               Job.status.in_((JobStatus.QUEUED, JobStatus.RUNNING)))
    ).scalar_one()  # fmt: skip
    return BatchLeft(max(0, num_unqueued or 0), num_unfinished)


def _order(deadline: datetime | None, created_at: datetime) -> tuple[float, float]:
    return (math.inf if deadline is None else deadline.timestamp(), created_at.timestamp())
