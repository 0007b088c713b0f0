"""The batch loop: moves every unfinished batch through its lifecycle, one step per pass.

Responsible for, per batch and pass:
- `validating`: read the input file once (streamed) and either record the request count
  and model (→ `in_progress`) or the errors by line (→ `failed`, nothing enqueued);
- `in_progress`: fan out the lines not yet enqueued (scheduler.batch_fanout), refresh
  `request_counts` and `usage` from the jobs' statuses, and once every job has finished,
  go to `finalizing`; past `expires_at`, stop the unfinished jobs and go to `expired`;
- `finalizing` / `cancelling` / expiring: stop unfinished jobs (queued ones are cancelled
  in the database, running ones also aborted in the engine), assemble the output and error
  files (scheduler.batch_results) and reach `completed`, `cancelled` or `expired`;
- an error that is no dependency outage (those are retried): the batch fails with its
  kind as the reason, at once while validating, else after MAX_UNEXPECTED_PASSES passes
  in a row, so that no batch is retried forever (tracebacks: one per kind a minute);
- on every terminal status, publish `<prefix>:batches:done:<id>` on Redis (it ends the
  batch's long-polls, `GET /v1/batches/{id}?wait=N`) and, when the batch has a callback
  URL, enqueue its `batch.*` webhook in the same transaction.

It belongs with the reconciler (scheduler/): like it, it reads the database as the source
of truth and writes to Kafka, it consumes no queue, and every step is idempotent — a pass
that dies half-way is simply done again by the next one. Slow work (reading files) runs
without holding the batch row's lock; each status change re-locks and re-checks the row.

Pace: passes come every `batch_poll_interval_s`, and sooner when there is work — the API
announces new and cancelled batches (`batches_wake_channel`), and a batch whose jobs are
finishing fast enough to end before the next pass asks for a pass when they should be
done. Validation and the first fan-out share a pass. At GPU rates a small batch runs in
well under a second, so an interval's wait at each end was most of its time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import redis
import redis.exceptions
import sqlalchemy.exc
from kafka import KafkaProducer
from kafka.errors import KafkaError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.error_log import ErrorLog
from core.settings import Settings
from scheduler.batch_fanout import fan_out
from scheduler.batch_input import validate_input
from scheduler.batch_results import add_result_file_rows, write_result_files
from scheduler.fanout_plan import plan_room
from scheduler.periodic import Wakeup
from storage.batch_jobs import (
    count_batch_jobs,
    has_jobs_stopped_since,
    stop_batch_jobs,
    sum_batch_usage,
)
from storage.batch_output import BATCH_CANCELLED, BATCH_EXPIRED, REQUEST_CANCELLED
from storage.batch_room import Pair, WaitingBatch, queued_batch_lines, waiting_batches
from storage.batches import Batch, BatchStatus, active_batch_ids, batch_object, lock_batch
from storage.events import publish_batch_done, publish_cancel
from storage.files import FileStore, get_file
from storage.models import utcnow
from storage.tenant_limits import tenant_weights
from storage.token_budget import TokenBudgets
from storage.webhook_events import BATCH_STATUS_TO_EVENT, enqueue_event

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds of fan-out per batch per pass, so one huge batch cannot stall the others.
FANOUT_BUDGET_S = 5.0
# Seconds between refreshes of a running batch's token usage. Summing it reads every
# succeeded job's row: once a pass, a 10,000-line embeddings batch spent a third of the
# scheduler's time there, beside the worker it shares the cores with. The final figure is
# summed when the batch ends.
USAGE_REFRESH_S = 10.0
# Passes in a row an unexpected error may stop a batch before the batch is failed (one
# for a batch that is validating: reading its file again meets the same error).
MAX_UNEXPECTED_PASSES = 3
# Dependency outages: the batch is not at fault, so the next pass simply retries.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    sqlalchemy.exc.OperationalError, sqlalchemy.exc.TimeoutError,
    redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, KafkaError,
)
# Shortest gap a batch's expected end may put between two passes.
MIN_PASS_GAP_S = 0.05
# Longest gap between passes once a batch is expected to end within an interval, for as
# long as its jobs keep finishing. Jobs finish in bursts (an embeddings step completes
# ~90 at once, a stream's last batch ends after the other's) and a pass that landed
# between two saw no progress and left the batch to the next interval: 10,000 embeddings
# were counted done 0.65 s after their last job, 1% of the batch's time.
TAIL_PASS_S = 0.1


class BatchRunner:
    """Advances batches: validate, fan out, count, finalize, cancel, expire."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session],
                 producer: KafkaProducer, redis_client: redis.Redis, store: FileStore,
                 wakeup: Wakeup | None = None) -> None:
        self.settings = settings
        self.sessions = sessions
        self.producer = producer
        self.redis = redis_client
        self.budgets = TokenBudgets(redis_client, prefix=settings.topic_prefix)
        self.store = store
        self.wakeup = wakeup or Wakeup()
        self._usage_summed_at: dict[str, float] = {}  # batch id -> monotonic time
        # batch id -> (monotonic time, jobs finished) at its last count
        # batch id -> (when its finished count last grew, that count, expected to end
        # within an interval then)
        self._last_count: dict[str, tuple[float, int, bool]] = {}
        # batch id -> passes in a row that failed unexpectedly on it
        self._num_unexpected: dict[str, int] = {}
        self.errors = ErrorLog(logger)

    def step(self) -> int:
        """One pass over every unfinished batch; returns how many were looked at.

        Validation comes first, so that a batch validated now shares this pass's fan-out
        room; then the batches with room are advanced in the plan's order (nearest
        deadline first within a model and priority), then the rest.
        """
        with self.sessions() as session:
            batch_ids = active_batch_ids(session, limit=1000)
            validating = set(session.scalars(
                select(Batch.id).where(Batch.status == BatchStatus.VALIDATING)))
        # Batches another scheduler finished: what was kept about them goes.
        active = set(batch_ids)
        self._usage_summed_at = {b: t for b, t in self._usage_summed_at.items() if b in active}
        self._last_count = {b: c for b, c in self._last_count.items() if b in active}
        self._num_unexpected = {b: n for b, n in self._num_unexpected.items() if b in active}
        failed = {b for b in batch_ids if b in validating
                  and self._attempt(b, self._validate_if_due, is_whole_step=False) is None}
        try:
            plans = self._plan_rooms()
        except TRANSIENT_ERRORS as e:
            self.errors.exception(e, "the fan-out could not be planned; retrying next pass",
                                  place="plan")
            plans = {}
        planned: set[str] = set()
        for plan in plans.values():
            spare = 0  # room a batch left unused (a spent token budget) goes on down the plan
            for batch_id, room in plan.items():
                planned.add(batch_id)
                if batch_id not in active or batch_id in failed:
                    continue
                given = room + spare
                added = self._attempt(batch_id, partial(self.advance, room=given))
                spare = given - (added or 0)
        for batch_id in batch_ids:
            if batch_id not in planned and batch_id not in failed:
                self._attempt(batch_id, partial(self.advance, room=0))
        return len(batch_ids)

    def _attempt(self, batch_id: str, work: Callable[[str], T], *,
                 is_whole_step: bool = True) -> T | None:
        """Run one batch's work, keeping an error to that batch; None if it raised. Only
        a whole step that succeeds ends a run of unexpected errors."""
        try:
            result = work(batch_id)
        except TRANSIENT_ERRORS as e:
            self.errors.exception(e, "batch %s: a dependency failed; retrying next pass",
                                  batch_id, place="dependency")
            return None
        except Exception as e:
            self._on_unexpected(batch_id, e)
            return None
        if is_whole_step:
            self._num_unexpected.pop(batch_id, None)
        return result

    def _plan_rooms(self) -> dict[Pair, dict[str, int]]:
        """This pass's fan-out rooms: (model, priority) -> batch id -> lines, each pair's
        batches in the order to enqueue them (scheduler.fanout_plan)."""
        with self.sessions() as session:
            waiting = waiting_batches(session, now=utcnow())
            if not waiting:
                return {}
            queued = queued_batch_lines(session)
            weights = tenant_weights(session)
        by_pair: dict[Pair, list[WaitingBatch]] = {}
        for batch in waiting:
            by_pair.setdefault((batch.model, batch.priority), []).append(batch)
        plans = {pair: plan_room(self.settings.batch_max_queued_lines, batches,
                                 queued.get(pair, {}), weights)
                 for pair, batches in by_pair.items()}
        return {pair: plan for pair, plan in plans.items() if plan}

    def _validate_if_due(self, batch_id: str) -> bool:
        """Validate a validating batch (expire it past its window); others wait for their
        turn in the pass. True, so that an error is told apart (None)."""
        with self.sessions() as session:
            batch = lock_batch(session, batch_id=batch_id)
            if batch is None or batch.status != BatchStatus.VALIDATING:
                return True
            is_past_window = utcnow() >= batch.expires_at
        if is_past_window:
            self._stop_and_finish(batch_id, BatchStatus.EXPIRED)
        else:
            self._validate(batch_id)
        return True

    def _on_unexpected(self, batch_id: str, error: Exception) -> None:
        """Log (rate-limited) an error no dependency outage explains; fail the batch once
        it cannot be validated, or once it failed MAX_UNEXPECTED_PASSES passes in a row.

        Such an error comes from the batch itself (its file, its jobs) or from a bug, and
        the next pass meets it again: retried forever, one batch re-read its whole input
        file every second and logged a traceback each time, and its client never heard.
        """
        num_passes = self._num_unexpected.get(batch_id, 0) + 1
        self._num_unexpected[batch_id] = num_passes
        self.errors.exception(error, "batch %s: step failed unexpectedly (pass %d of %d)",
                              batch_id, num_passes, MAX_UNEXPECTED_PASSES, place="step")
        try:
            self._fail(batch_id, error, is_out_of_passes=num_passes >= MAX_UNEXPECTED_PASSES)
        except Exception as e:
            self.errors.exception(e, "batch %s: could not be failed; retrying next pass",
                                  batch_id, place="fail")

    def _fail(self, batch_id: str, error: Exception, *, is_out_of_passes: bool) -> None:
        """Move the batch to `failed` with the error's kind as its reason, stopping its
        unfinished jobs, if it is validating or out of passes."""
        with self.sessions() as session:
            batch = lock_batch(session, batch_id=batch_id)
            if batch is None or batch.status.is_terminal:
                return
            if not (is_out_of_passes or batch.status == BatchStatus.VALIDATING):
                return
            running_ids = stop_batch_jobs(session, batch_id=batch_id)
            batch.errors = [_error(
                "internal_error",
                f"The batch could not be processed ({type(error).__name__} while it was "
                f"{batch.status.value}); it was stopped rather than retried. Check the "
                "input file, or report the batch id to the operator.")]
            batch.move_to(BatchStatus.FAILED)
            self._on_terminal(session, batch)
            session.commit()
        for job_id in running_ids:
            publish_cancel(self.redis, prefix=self.settings.topic_prefix, job_id=job_id)
        self._num_unexpected.pop(batch_id, None)
        self._publish_done(batch)
        logger.warning("batch %s: failed after an unexpected %s", batch_id,
                       type(error).__name__)

    def advance(self, batch_id: str, *, room: int | None = None) -> int:
        """Move one batch as far as it can go now, enqueuing up to `room` of its lines
        (None: its room in a plan made for it now); returns the lines enqueued."""
        with self.sessions() as session:
            batch = lock_batch(session, batch_id=batch_id)
            if batch is None:
                return 0
            status, is_past_window = batch.status, utcnow() >= batch.expires_at
        if status == BatchStatus.VALIDATING:
            if is_past_window:
                self._stop_and_finish(batch_id, BatchStatus.EXPIRED)
                return 0
            if self._validate(batch_id):
                return self._run(batch_id, is_past_window=False, room=room)
        elif status == BatchStatus.IN_PROGRESS:
            return self._run(batch_id, is_past_window=is_past_window, room=room)
        elif status == BatchStatus.FINALIZING:
            self._stop_and_finish(batch_id, BatchStatus.COMPLETED)
        elif status == BatchStatus.CANCELLING:
            self._stop_and_finish(batch_id, BatchStatus.CANCELLED)
        return 0

    def _validate(self, batch_id: str) -> bool:
        """Validate the input file; True if the batch moved on to `in_progress`."""
        with self.sessions() as session:
            batch = session.get(Batch, batch_id)
            assert batch is not None
            file = get_file(session, file_id=batch.input_file_id, tenant_id=batch.tenant_id,
                            include_expired=True)
            endpoint, model_override = batch.endpoint, batch.model_override
        errors: list[dict[str, object]] = []
        num_requests, model = 0, None
        if file is None:
            errors = [_error("file_not_found", "the input file no longer exists")]
        elif file.num_bytes > self.settings.max_file_bytes:
            errors = [_error("file_too_large", f"the input file has {file.num_bytes} bytes; "
                             f"at most {self.settings.max_file_bytes} are accepted")]
        else:
            with self.store.open(file.id) as handle:
                report = validate_input(
                    handle, endpoint=endpoint, served_models=self.settings.served_models,
                    max_requests=self.settings.batch_max_requests,
                    max_line_bytes=self.settings.max_request_bytes,
                    model_override=model_override,
                )
            errors, num_requests, model = report.errors, report.num_requests, report.model
        with self.sessions() as session:
            batch = lock_batch(session, batch_id=batch_id)
            if batch is None or batch.status != BatchStatus.VALIDATING:
                return False
            batch.num_requests, batch.model = num_requests, model
            if errors:
                batch.errors = errors
                batch.move_to(BatchStatus.FAILED)
                self._on_terminal(session, batch)
            else:
                batch.move_to(BatchStatus.IN_PROGRESS)
            session.commit()
        self._publish_done(batch)
        logger.info("batch %s: validation %s (%d request(s), %d error(s))", batch_id,
                    "failed" if errors else "passed", num_requests, len(errors))
        return not errors

    def _run(self, batch_id: str, *, is_past_window: bool, room: int | None) -> int:
        with self.sessions() as session:
            batch = session.get(Batch, batch_id)
            assert batch is not None
            is_fanned_out = batch.num_enqueued >= batch.num_requests
        num_added = 0
        if not is_fanned_out and not is_past_window:
            if room is None:
                room = next((plan[batch_id] for plan in self._plan_rooms().values()
                             if batch_id in plan), 0)
            num_added = fan_out(self.settings, self.sessions, self.producer, self.store,
                                batch_id=batch_id, budget_s=FANOUT_BUDGET_S, room=room,
                                budgets=self.budgets)
        with self.sessions() as session:
            batch = lock_batch(session, batch_id=batch_id)
            if batch is None or batch.status != BatchStatus.IN_PROGRESS:
                return num_added
            counts = count_batch_jobs(session, batch_id=batch_id)
            batch.num_completed = counts.num_succeeded
            batch.num_failed = counts.num_failed
            now = time.monotonic()
            if now - self._usage_summed_at.get(batch_id, -USAGE_REFRESH_S) >= USAGE_REFRESH_S:
                _set_usage(session, batch)
                self._usage_summed_at[batch_id] = now
            is_done = batch.num_enqueued >= batch.num_requests and counts.num_unfinished == 0
            if is_done and is_past_window and has_jobs_stopped_since(
                    session, batch_id=batch_id, since=batch.expires_at):
                # An expiry stopped these jobs and did not get to its status (its pass
                # died, or another scheduler is still writing the files): carry it on.
                is_done = False
            if is_done:
                batch.move_to(BatchStatus.FINALIZING)
            elif batch.num_enqueued >= batch.num_requests:
                self._pass_when_done(batch_id, num_finished=counts.num_succeeded
                                     + counts.num_failed, num_unfinished=counts.num_unfinished)
            session.commit()
        if is_done:
            self._stop_and_finish(batch_id, BatchStatus.COMPLETED)
        elif is_past_window:
            self._stop_and_finish(batch_id, BatchStatus.EXPIRED)
        return num_added

    def _pass_when_done(self, batch_id: str, *, num_finished: int, num_unfinished: int) -> None:
        """Ask for a pass when, at the pace since the count last grew, the last job should be
        done, if that comes before the next pass anyway; then pass every TAIL_PASS_S or
        sooner until it is, while jobs keep finishing."""
        now = time.monotonic()
        interval = self.settings.batch_poll_interval_s
        last = self._last_count.get(batch_id)
        if last is not None and num_finished <= last[1]:
            # Nothing finished since: the pace stays measured from the last growth. A
            # batch in its tail is looked at again soon, unless it stalled for an
            # interval (a lost worker): then the interval's pace is enough.
            if last[2] and now - last[0] < interval:
                self.wakeup.soon(TAIL_PASS_S)
            return
        if last is None:
            self._last_count[batch_id] = (now, num_finished, False)
            return
        seconds_left = num_unfinished * (now - last[0]) / (num_finished - last[1])
        is_tail = seconds_left < interval
        self._last_count[batch_id] = (now, num_finished, is_tail)
        if is_tail:
            self.wakeup.soon(min(max(seconds_left, MIN_PASS_GAP_S), TAIL_PASS_S))

    def _stop_and_finish(self, batch_id: str, final: BatchStatus) -> None:
        """Stop unfinished jobs, write the result files and move to `final`."""
        with self.sessions() as session:
            batch = lock_batch(session, batch_id=batch_id)
            if batch is None or not batch.can_move_to(final):
                return
            running_ids = stop_batch_jobs(session, batch_id=batch_id)
            session.commit()
        for job_id in running_ids:
            publish_cancel(self.redis, prefix=self.settings.topic_prefix, job_id=job_id)
        stopped_code = {BatchStatus.EXPIRED: BATCH_EXPIRED,
                        BatchStatus.CANCELLED: BATCH_CANCELLED}.get(final, REQUEST_CANCELLED)
        with self.sessions() as session:
            batch = session.get(Batch, batch_id)
            assert batch is not None
            files = write_result_files(session, self.store, batch, stopped_code=stopped_code,
                                       max_line_bytes=self.settings.max_request_bytes)
        with self.sessions() as session:
            batch = lock_batch(session, batch_id=batch_id)
            if batch is None or not batch.can_move_to(final):
                # Someone else finished it meanwhile; these files are not referenced.
                for file_id in (files.output_file_id, files.error_file_id):
                    if file_id is not None:
                        self.store.delete(file_id)
                return
            add_result_file_rows(session, batch, files)
            _set_usage(session, batch)
            self._usage_summed_at.pop(batch_id, None)
            self._last_count.pop(batch_id, None)
            batch.move_to(final)
            self._on_terminal(session, batch)
            session.commit()
        self._publish_done(batch)
        logger.info("batch %s: %s (%d completed, %d failed of %d)", batch_id, final.value,
                    batch.num_completed, batch.num_failed, batch.num_requests)

    def _on_terminal(self, session: Session, batch: Batch) -> None:
        """Enqueue the batch's webhook event with its terminal status (same transaction)."""
        if batch.callback_url:
            enqueue_event(session, tenant_id=batch.tenant_id,
                          event_type=BATCH_STATUS_TO_EVENT[batch.status.value],
                          url=batch.callback_url, payload=batch_object(batch))

    def _publish_done(self, batch: Batch) -> None:
        """Announce a terminal status on Redis (best effort: the database is the truth)."""
        if not batch.status.is_terminal:
            return
        publish_batch_done(self.redis, prefix=self.settings.topic_prefix, batch_id=batch.id,
                           status=batch.status.value)

def _error(code: str, message: str) -> dict[str, object]:
    return {"code": code, "line": None, "message": message, "param": None}


def _set_usage(session: Session, batch: Batch) -> None:
    usage = sum_batch_usage(session, batch_id=batch.id)
    batch.input_tokens = usage.input_tokens
    batch.cached_tokens = usage.cached_tokens
    batch.output_tokens = usage.output_tokens
