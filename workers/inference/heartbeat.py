"""A worker's heartbeat: its row in the `workers` table, stamped by a small daemon thread.

Why one row per worker rather than a lease on each claimed job: a lease has to be renewed
on every running job (a worker holding 128 jobs rewrites 128 hot rows per interval, racing
the result writes on the same rows), while a heartbeat is one UPDATE per interval whatever
the worker runs. Jobs already name their worker (`jobs.worker_id`), so the worker's
liveness says whether they have an owner; the table also shows operators who is alive.

Responsible for:
- the first beat, written before `start` returns, so the row exists before the worker
  claims anything (otherwise its first jobs would look orphaned); an unreachable
  database fails the start;
- one beat every interval on a daemon thread. A failed beat is logged and retried at
  the next tick: a worker that cannot reach the database for the whole timeout cannot
  store results either, and its jobs are better off with another worker;
- deleting the row at stop, so whatever the worker leaves `running` is handed back by
  the reconciler's next pass instead of after the timeout;
- with a `LoopPulse`, beating only while the poll loop goes round: once it has been silent
  for `loop_stall_timeout_s` the beats stop (logged once), so a hung loop is dead to the
  reconciler and to whoever watches the liveness file;
- touching the liveness file (when there is one) with every beat given, whether the
  database took it or not (see workers/inference/liveness);
- with a `probe_s`, a look at the pace every `probe_s` and a beat before the interval
  when it is news: a pace known where the last beat had none, or one moved by more than
  `PACE_NEWS_RATIO` (at most once a second). The estimates read the pace from the last
  beat, and an interval-old one missed or misjudged whole batches: a tiny model's
  1,000-line batch runs in ~2 s, and with a 5 s interval every estimate of it was missing;
  a 20,000-line one was estimated at the idle worker's full-batch pace (78,600-146,500
  tokens/s) for its first 4-5 s, while it ran at 33,900-37,500 (bench/eta_accuracy.py:
  -53% to -78%).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from core.liveness_file import touch
from storage.workers import record_heartbeat, remove_worker
from workers.inference.liveness import LoopPulse
from workers.inference.service_rate import Pace

logger = logging.getLogger(__name__)

# A pace that moved by more than this factor since the last beat is worth a beat now: it
# moves every estimate by as much, against a target of +/-20% (issue 43).
PACE_NEWS_RATIO = 1.25
# Beats for a moved pace come at most this often (a pace known at last: at once).
PACE_NEWS_GAP_S = 1.0


class Heartbeat:
    """Keeps `worker_id`'s row fresh every `interval_s` between start and stop."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        worker_id: str,
        interval_s: float,
        model: str | None = None,
        pace: Callable[[], Pace] | None = None,
        pulse: LoopPulse | None = None,
        loop_stall_timeout_s: float = 60.0,
        liveness_file: Path | None = None,
        probe_s: float | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"heartbeat interval must be positive seconds, got {interval_s}")
        self.worker_id = worker_id
        self.interval_s = interval_s
        # What each beat also carries for the estimates: the served model and its pace.
        self.model = model
        self.pace = pace
        self.pulse = pulse
        self.loop_stall_timeout_s = loop_stall_timeout_s
        self.liveness_file = liveness_file
        self.probe_s = probe_s if pace is not None else None
        # The pace the last beat wrote, and when (monotonic).
        self._beaten_tokens_per_s: float | None = None
        self._beaten_at = -math.inf
        # Beats written before their interval because the pace was news.
        self.num_early_beats = 0
        self._pace_failed = False  # the last read of the pace raised (logged once)
        self._is_stalled = False
        # Ticks given up because the poll loop had stalled.
        self.num_skipped_beats = 0
        self._sessions = sessions
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_running(self) -> bool:
        """Whether the beating thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Write the first beat (raising if it fails), then beat on a daemon thread."""
        if self._thread is not None:
            raise RuntimeError(f"heartbeat of {self.worker_id} already started")
        self.beat()
        self._touch()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()
        logger.info("worker %s heart-beating every %.1fs", self.worker_id, self.interval_s)

    def beat(self, pace: Pace | None = None) -> None:
        """Stamp the row now (inserting it if missing), with the pace measured since (or
        `pace`, just sampled)."""
        if pace is None:
            pace = self._read_pace() or Pace()
        self._beaten_tokens_per_s = pace.reported_tokens_per_s
        self._beaten_at = time.monotonic()
        left = pace.work_left
        with self._sessions() as session:
            record_heartbeat(session, worker_id=self.worker_id, model=self.model,
                             tokens_per_s=pace.reported_tokens_per_s, step_s=pace.step_s,
                             num_requests_left=left.num_requests if left else None,
                             num_tokens_to_compute=(left.num_tokens_to_compute if left
                                                    else None),
                             num_output_tokens_left=left.num_output_tokens if left else None,
                             solo_step_s=pace.solo_step_s)
            session.commit()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop beating and delete the row: the worker no longer owns anything."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        try:
            with self._sessions() as session:
                remove_worker(session, worker_id=self.worker_id)
                session.commit()
        except SQLAlchemyError as e:
            # The row then ages out: its jobs are handed back after the timeout instead.
            logger.warning("cannot delete the heartbeat row of %s: %s", self.worker_id, e)

    def __enter__(self) -> Heartbeat:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self) -> None:
        due = time.monotonic() + self.interval_s
        while True:
            wait_s = due - time.monotonic()
            if self.probe_s is not None:
                wait_s = min(wait_s, self.probe_s)
            if self._stop.wait(max(0.0, wait_s)):
                return
            pace: Pace | None = None
            if time.monotonic() < due:
                pace = self._read_pace()
                if pace is None or not self._is_news(pace):
                    continue
                self.num_early_beats += 1
            due = time.monotonic() + self.interval_s
            if self._loop_is_stalled():
                self.num_skipped_beats += 1
                continue
            self._touch()
            try:
                self.beat(pace)
            except SQLAlchemyError as e:
                logger.warning("heartbeat of %s failed (%s); retrying in %.1fs",
                               self.worker_id, e, self.interval_s)

    def _read_pace(self) -> Pace | None:
        """The pace now; None without one or when it cannot be read (logged once): a beat
        without a pace still keeps the worker alive, and a dead heartbeat thread would
        hand its jobs back."""
        if self.pace is None:
            return None
        try:
            pace = self.pace()
        except Exception:
            if not self._pace_failed:
                logger.exception("worker %s: cannot read its pace; beating without it",
                                 self.worker_id)
            self._pace_failed = True
            return None
        self._pace_failed = False
        return pace

    def _is_news(self, pace: Pace) -> bool:
        """Whether `pace` differs enough from the last beat's to be written before the
        interval."""
        new, old = pace.reported_tokens_per_s, self._beaten_tokens_per_s
        if (new is None) != (old is None):
            return True
        if not new or not old or time.monotonic() - self._beaten_at < PACE_NEWS_GAP_S:
            return False
        return abs(math.log(new / old)) > math.log(PACE_NEWS_RATIO)

    def _loop_is_stalled(self) -> bool:
        """Whether the poll loop has been silent past the stall timeout (logged once)."""
        if self.pulse is None:
            return False
        silent_s = self.pulse.silent_for_s()
        is_stalled = silent_s > self.loop_stall_timeout_s
        if is_stalled and not self._is_stalled:
            logger.error("worker %s: the poll loop has not gone round for %.0fs; beating no "
                         "more, so the worker is replaced and its jobs handed back",
                         self.worker_id, silent_s)
        elif self._is_stalled and not is_stalled:
            logger.warning("worker %s: the poll loop goes round again; beating again",
                           self.worker_id)
        self._is_stalled = is_stalled
        return is_stalled

    def _touch(self) -> None:
        if self.liveness_file is None:
            return
        try:
            touch(self.liveness_file)
        except OSError as e:
            logger.warning("cannot touch the liveness file %s: %s", self.liveness_file, e)
