"""Riding out a database that is away, instead of leaving with the model loaded.

A worker whose result write or claim meets a lost connection (PostgreSQL restarted or
failing over, a network cut, SQLite locked past its busy timeout) used to raise out of
its loop: the process ended, `up` or Kubernetes started another, and that one loaded the
model again — seconds here, minutes for a large model on a GPU — for a database that
was back in seconds. Now the worker keeps what it could not write and tries again:
finished results stay in memory (their offsets unacknowledged, so a worker that dies
meanwhile loses nothing: the jobs are redelivered), no new job starts, and the tries
back off from FIRST_RETRY_S to MAX_RETRY_S. Errors that are not about reaching the
database (a constraint, a bad statement) still end the worker: retrying cannot fix them.

An outage longer than the heartbeat timeout lets the reconciler hand this worker's
running jobs to others once the database is back; whichever result is written first
stands (the writes only finish unfinished jobs), so a job still ends exactly once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from core import metrics

logger = logging.getLogger(__name__)

FIRST_RETRY_S = 0.5
MAX_RETRY_S = 10.0


def is_outage(error: BaseException) -> bool:
    """Whether a database error means the database cannot be reached (worth waiting out)."""
    if isinstance(error, OperationalError | InterfaceError | PoolTimeoutError):
        return True
    return isinstance(error, DBAPIError) and error.connection_invalidated


class DatabaseOutage:
    """Whether the database is away, and when to try it again (see the module docstring)."""

    def __init__(self, *, first_retry_s: float = FIRST_RETRY_S,
                 max_retry_s: float = MAX_RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._first_retry_s = first_retry_s
        self._max_retry_s = max_retry_s
        self._clock = clock
        self._away_since: float | None = None
        self._retry_s = first_retry_s
        self._next_try_at = 0.0

    @property
    def is_away(self) -> bool:
        """True from a failed call until one succeeds."""
        return self._away_since is not None

    def may_try(self) -> bool:
        """Whether a call may go to the database now (always, unless it is away)."""
        return self._away_since is None or self._clock() >= self._next_try_at

    def failed(self, error: SQLAlchemyError, *, doing: str) -> None:
        """A call `doing` something failed: schedule the next try, or raise `error` again
        when it is not an outage."""
        if not is_outage(error):
            raise error
        metrics.WORKER_DATABASE_ERRORS.inc()
        now = self._clock()
        if self._away_since is None:
            self._away_since, self._retry_s = now, self._first_retry_s
            logger.warning("database unreachable while %s (%s); holding results and "
                           "starting nothing until it answers", doing,
                           str(error).splitlines()[0])
        else:
            self._retry_s = min(self._retry_s * 2, self._max_retry_s)
        self._next_try_at = now + self._retry_s

    def succeeded(self) -> None:
        """A call went through: the database is back, if it was away."""
        if self._away_since is not None:
            logger.info("database reachable again after %.1f s", self._clock() - self._away_since)
            self._away_since = None
