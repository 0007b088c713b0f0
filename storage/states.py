"""The job state machine: which status may follow which.

    queued ◄──► running ──► succeeded | failed | cancelled | expired
      │           ▲──┘ (re-claim after a redelivery)
      └──► failed | cancelled | expired

expired: still unfinished at its deadline (the reconciler moves it).

running → queued hands a job back when its worker drained without finishing it, or
stopped heart-beating (see `storage.workers`).

The query functions in `storage.jobs` enforce the same table atomically in SQL
(`UPDATE ... WHERE status IN (...)`); `check_transition` is for code that moves a loaded
row and for explaining a refusal.
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import ColumnElement

from storage.models import Job, JobStatus

_QUEUED, _RUNNING = JobStatus.QUEUED, JobStatus.RUNNING

# Statuses a job can still leave; result writes only ever touch these.
UNFINISHED = (_QUEUED, _RUNNING)

# old status → the statuses it may move to.
ALLOWED_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset(
        {_RUNNING, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED}
    ),
    # running → running: a worker re-claims a job Kafka redelivered after a crash.
    # running → queued: handed back by a draining worker, or by the reconciler when the
    # worker that claimed it stopped heart-beating.
    JobStatus.RUNNING: frozenset(
        {_QUEUED, _RUNNING, JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED,
         JobStatus.EXPIRED}
    ),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
    JobStatus.EXPIRED: frozenset(),
}


class IllegalTransition(ValueError):
    """A status change the job state machine does not allow."""

    def __init__(self, old: JobStatus, new: JobStatus) -> None:
        allowed = ", ".join(sorted(s.value for s in ALLOWED_TRANSITIONS[old])) or "nothing"
        super().__init__(
            f"illegal job transition {old.value} → {new.value}: "
            f"from {old.value} a job may only become {allowed}"
        )
        self.old = old
        self.new = new


def can_transition(old: JobStatus, new: JobStatus) -> bool:
    """Whether a job in `old` may move to `new`."""
    return new in ALLOWED_TRANSITIONS[old]


def check_transition(old: JobStatus, new: JobStatus) -> None:
    """Raise IllegalTransition unless a job in `old` may move to `new`."""
    if not can_transition(old, new):
        raise IllegalTransition(old, new)


def sources_of(new: JobStatus) -> frozenset[JobStatus]:
    """Every status from which a job may move to `new`."""
    return frozenset(old for old, targets in ALLOWED_TRANSITIONS.items() if new in targets)


def status_among_listed(statuses: Collection[JobStatus]) -> ColumnElement[bool]:
    """`jobs.status IN statuses`, for a statement that lists its jobs by id, written as
    NOT IN the other statuses so that no index can serve it and the ids are looked up by
    the primary key.

    Written plainly, SQLite's planner (no statistics) served the status term from
    `ix_jobs_status_queued_at` once a dozen ids were listed: a worker's claim of 56 jobs
    read every queued job's index entry (35 ms behind a 50,000-line batch, against 1.8),
    and so did each fan-out chunk's publish stamp, growing with the backlog.
    """
    others = sorted(set(JobStatus) - set(statuses))
    return Job.status.not_in(others) if others else Job.status.is_not(None)
