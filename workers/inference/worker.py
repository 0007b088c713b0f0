"""The inference worker's poll loop: Kafka → engine → database, at least once.

Responsible for, on the polling thread (the engine steps on its own, see engine_loop):
- polling the three priority topics with a short timeout into a prefetch buffer, and
  starting jobs from it most urgent first while there is room in flight (lower
  priorities paused while a higher one has a backlog, partitions paused while their
  prefetch is full, so everything is paused when the worker is full; see priority);
- per record: decode (a malformed record is logged and acknowledged) and gather the
  jobs of the poll, which `job_starter` starts as one batch (skip, answer from a cache,
  refuse, or claim and add to the engine's running batch);
- per engine step's finished requests: store the results in one transaction (idempotent),
  fill the caches, announce them, then acknowledge their offsets; commit every partition
  up to its first unpersisted offset; a partition silent with records waiting is
  restarted (`stall_watchdog`), and records kafka-python parked are released
  (`parked_records`);
- a database that cannot be reached: results kept and stored again, nothing new started,
  the tries backing off, until it answers (`db_outage`), instead of leaving the process;
- cancellations (Redis) abort the job in the engine;
- after a rebalance, restarting each partition from its committed offset (as a new owner
  would) and releasing in-flight jobs whose partitions went to another worker;
- on stop: fetch nothing more, finish in-flight work up to the drain timeout, release the
  rest (their offsets stay uncommitted, so they are redelivered), commit, return.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime

import redis
from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaError
from sqlalchemy.exc import SQLAlchemyError

from core import metrics
from core.messages import JobMessage
from core.settings import Settings
from core.topics import Priority
from storage.events import CancelSubscription
from workers.engine import RequestOutput
from workers.inference.batch_drain import BatchDrains
from workers.inference.db_outage import DatabaseOutage
from workers.inference.early_join import EarlyJoin
from workers.inference.engine_loop import EngineLoop, FinishedRequest
from workers.inference.fetch_wait import FetchWait, WorkPace, num_finishable
from workers.inference.intake import InFlightCounts, can_overtake, can_take_any, count_key
from workers.inference.job_starter import Candidate, InFlightJob, JobStarter
from workers.inference.job_store import JobStore
from workers.inference.liveness import LoopPulse
from workers.inference.loop_pacing import (
    empty_polls_after,
    finished_wait_s,
    max_inflight,
    poll_timeout_ms,
)
from workers.inference.offsets import OffsetTracker
from workers.inference.outcomes import OutcomeRecorder
from workers.inference.parked_records import release_parked_records
from workers.inference.prefetch import PrefetchBuffer
from workers.inference.priority import PriorityPauser
from workers.inference.rebalance import RebalanceListener, offsets_to_commit
from workers.inference.record_intake import HeldRecords, place_record
from workers.inference.remote_engine import RemoteEngineLoop
from workers.inference.remote_requests import RemoteOutput
from workers.inference.stall_watchdog import StallWatchdog
from workers.inference.tenant_share import TenantWeights, record_tenant

logger = logging.getLogger(__name__)

# How long a follow (storage.token_streams.publish_follow) of a job this worker has not
# started holds: its follower repeats it every few seconds while the job waits.
FOLLOW_MEMORY_S = 10.0
# Seconds over which the drain measures how fast jobs finish: a worker busy this long
# that finished none in it releases everything at once when asked to stop.
DRAIN_PACE_WINDOW_S = 10.0


class Worker:
    """One worker's poll loop over already-built parts (see `run_worker` for wiring)."""

    def __init__(
        self,
        settings: Settings,
        *,
        consumer: KafkaConsumer,
        engine_loop: EngineLoop | RemoteEngineLoop,
        store: JobStore,
        cancels: CancelSubscription,
        worker_id: str,
        pulse: LoopPulse | None = None,
        joined: EarlyJoin | None = None,
    ) -> None:
        self.settings = settings
        self.worker_id = worker_id
        # The consumer's group join begun while the engine loaded; None: subscribe in run().
        self._joined = joined
        # Stamped every turn of the loop: the heartbeat stops when it stalls (liveness).
        self._pulse = pulse or LoopPulse()
        self._consumer = consumer
        self._engine = engine_loop
        self._store = store
        self._outcomes = OutcomeRecorder(
            store, tokenizer=lambda: getattr(self._engine.engine, "tokenizer", None))
        self._cancels = cancels
        self._stop = threading.Event()
        self._hurry = threading.Event()  # a second stop request: release, do not drain
        self._is_redis_down = False
        self._lock = threading.Lock()
        self._tracker = OffsetTracker()
        self._inflight: dict[str, InFlightJob] = {}
        # `_inflight` by priority and tenant, kept as jobs come and go: the loop reads them
        # every turn, and counting 512 jobs afresh each time was a sixth of its main thread.
        self._counts = InFlightCounts()
        # Finished in the engine, not yet stored (the database was away), and jobs taken
        # from prefetch whose start met the same: both tried again once it answers.
        self._unstored: list[FinishedRequest] = []
        self._unstarted: dict[str, Candidate] = {}
        self._held = HeldRecords()  # see record_intake
        self._drains = BatchDrains()
        self._database = DatabaseOutage()
        self._max_inflight = max_inflight(settings, engine_loop.engine)
        topic_rank = {topic: Priority(p).rank for p, topic in settings.job_topics.items()}
        self._pauser = PriorityPauser(topic_rank)
        # Within a priority, tenants share starts by weight (see prefetch).
        self._weight_of = TenantWeights(store.tenant_weights).weight_of
        self._prefetch: PrefetchBuffer[ConsumerRecord] = PrefetchBuffer(
            topic_rank, tenant_of=record_tenant, weight_of=self._weight_of)
        # Records a partition may hold here before it is paused: enough to refill the
        # whole in-flight bound from one partition without waiting for a fetch, and to
        # hold the batches' whole queued window (fan-out), so that another tenant's record
        # published behind it is seen, and started within its share (intake), at once
        # rather than after the batch's lines ahead of it on the partition have started.
        self._prefetch_limit = max(self._max_inflight, settings.batch_max_queued_lines)
        self._listener = RebalanceListener(consumer, self._tracker, self._lock, self._pauser)
        self._watchdog = StallWatchdog(consumer, stall_after_s=settings.worker_stall_after_s)
        self._fetch_wait = FetchWait(consumer)
        self._pace = WorkPace()
        # Jobs an API process asked to stream before this worker started them, and until
        # when that holds (followers repeat the ask while their job waits).
        self._follows: dict[str, float] = {}
        # The pace the drain judges by: over a longer window, since releasing a job that
        # would have finished costs its whole computation again elsewhere.
        self._drain_pace = WorkPace(window_s=DRAIN_PACE_WINDOW_S)
        self._starter = JobStarter(settings, store=store, outcomes=self._outcomes,
                                   engine=engine_loop, worker_id=worker_id, ack=self._ack,
                                   is_followed=self._is_followed, weight_of=self._weight_of)
        # Called once, after the first poll that returns with partitions assigned.
        self.on_consuming: Callable[[], None] | None = None

    @property
    def num_inflight(self) -> int:
        """Jobs in the engine right now."""
        return len(self._inflight)

    def request_stop(self) -> None:
        """Begin a clean shutdown (safe from a signal handler or another thread); asked
        again while draining, hand every unfinished job back now instead."""
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()
        self._engine.wake()  # a full worker's wait would hold the drain back FULL_WAIT_S

    def run(self) -> None:
        """Subscribe, process jobs until asked to stop, then drain and commit."""
        if self._joined is not None:
            self._joined.hand_over(self._listener)
        else:
            self._consumer.subscribe(list(self.settings.job_topics.values()),
                                     listener=self._listener)
        logger.info("worker %s consuming %s", self.worker_id,
                    ", ".join(self.settings.job_topics.values()))
        num_empty_polls = 0
        while not self._stop.is_set():
            self._pulse.beat()
            self._check_engine()
            self._housekeeping(finished_wait_s=finished_wait_s(
                len(self._inflight), self._max_inflight, num_empty_polls,
                can_take_more_urgent=can_take_any(self._counts.by_rank, self._max_inflight)))
            num_started = self._start_prefetched()
            self._pauser.update(
                self._consumer, prefetched=self._prefetch.counts(), limit=self._prefetch_limit
            )
            release_parked_records(self._consumer)
            expecting_s = self._fetch_wait.before_poll(
                is_idle=not self._inflight and not len(self._prefetch))
            batches = self._consumer.poll(
                timeout_ms=poll_timeout_ms(len(self._inflight), expecting_s))
            if self._on_new_assignment():
                batches = {}  # fetched before the restart from committed offsets: refetched
            if self.on_consuming is not None and self._consumer.assignment():
                self.on_consuming()
                self.on_consuming = None
            self._watchdog.on_records(batches)
            if restarted := self._watchdog.check(is_idle=not self._inflight and not batches
                                                 and not len(self._prefetch)):
                self._prefetch.drop(restarted)
            with self._lock:
                for tp, records in batches.items():
                    for record in records:
                        self._tracker.track(tp, record.offset)
                        self._prefetch.add(tp, record)
            num_started += self._start_prefetched()
            num_empty_polls = empty_polls_after(num_empty_polls, brought_records=bool(batches),
                                                num_started=num_started)
            self._fetch_wait.on_poll(
                batches, is_hungry=not len(self._prefetch)
                and len(self._inflight) < self._max_inflight,
                seconds_of_work=self._pace.seconds_of_work(
                    len(self._prefetch) + len(self._inflight)),
                is_idle=not self._inflight and not len(self._prefetch),
                can_overtake=can_overtake(self._counts.by_rank, self._prefetch.most_urgent_rank(),
                                          self._max_inflight))
            metrics.WORKER_INFLIGHT.set(len(self._inflight))
        self._drain()

    def _start_prefetched(self) -> int:
        """Start prefetched jobs, most urgent first, a batch at a time while there is room;
        none while results wait for the database (see db_outage). How many started."""
        num_started = 0
        if self._unstored or not self._database.may_try():
            return num_started
        while True:
            candidates, self._unstarted = self._unstarted, {}
            # Records come out most urgent first, so the candidates taken so far are all
            # at least as urgent as the next one (see intake: the bound is by urgency,
            # and within a priority by tenant while several have records here).
            counts = self._counts.copy()
            for candidate in candidates.values():
                counts.add(*count_key(candidate.message))
            while (rank := self._prefetch.most_urgent_rank()) is not None:
                item = self._prefetch.pop_most_urgent(counts.may_start(
                    rank, self._max_inflight, waiting=self._prefetch.tenants_waiting(rank),
                    weight_of=self._weight_of))
                if item is None:
                    break
                num_before = len(candidates)
                self._take_record(*item, candidates)
                if len(candidates) > num_before:
                    counts.add(rank, record_tenant(item[1]))
            if not candidates:
                return num_started
            try:
                started = self._starter.start(candidates)
            except SQLAlchemyError as e:
                self._database.failed(e, doing="starting jobs")
                # Nothing of theirs reached the engine; what was settled is settled again
                # (idempotently) on the next try.
                self._unstarted = candidates
                return num_started
            self._database.succeeded()
            for job in started:
                self._inflight[job.message.job_id] = job
                self._counts.add(*count_key(job.message))
            num_started += len(started)

    def _pop_inflight(self, job_id: str) -> InFlightJob | None:
        if (job := self._inflight.pop(job_id, None)) is not None:
            self._counts.remove(*count_key(job.message))
        return job

    def _check_engine(self) -> None:
        if not self._engine.is_healthy:
            raise RuntimeError("the engine thread failed; stopping") from self._engine.failure

    def _housekeeping(self, finished_wait_s: float = 0.0) -> None:
        finished = self._engine.take_finished(finished_wait_s)
        self._unstored.extend(finished)
        self._store_finished()
        self._pace.on_loop(num_finished=len(finished), num_inflight=len(self._inflight))
        self._drain_pace.on_loop(num_finished=len(finished), num_inflight=len(self._inflight))
        self._handle_cancels()
        self._on_new_assignment()
        self._commit()

    def _drain(self) -> None:
        """Stop fetching, let in-flight jobs finish until the drain timeout, then give up."""
        self._pauser.pause_all(self._consumer)
        self._prefetch.clear()  # never started, never acknowledged: redelivered
        self._held.clear()
        deadline = time.monotonic() + self.settings.worker_drain_timeout_s
        logger.info(
            "draining %d in-flight jobs (up to %.0f s)",
            len(self._inflight),
            self.settings.worker_drain_timeout_s,
        )
        while (self._inflight and time.monotonic() < deadline and self._engine.is_healthy
               and not self._hurry.is_set()):
            self._pulse.beat()
            num_keep = num_finishable(
                self._drain_pace.seconds_of_work(len(self._inflight)),
                num_jobs=len(self._inflight), seconds_left=deadline - time.monotonic())
            if num_keep < len(self._inflight):
                # Oldest started first: the likeliest to be nearly done.
                self._release(list(self._inflight.values())[num_keep:],
                              why="cannot finish before the drain timeout")
            self._housekeeping(finished_wait_s=0.1)
            # Keeps taking part in rebalances; everything is paused, so nothing is fetched.
            self._consumer.poll(timeout_ms=0)
        self._release(list(self._inflight.values()),
                      why="asked to stop at once" if self._hurry.is_set() else "unfinished")
        self._commit()
        metrics.WORKER_INFLIGHT.set(0)

    def _release(self, jobs: list[InFlightJob], *, why: str) -> None:
        """Abort `jobs` and hand them back to `queued` now; their records stay
        unacknowledged, so Kafka redelivers them too (here or elsewhere)."""
        if not jobs:
            return
        for job in jobs:
            job.is_released = True
            self._engine.abort(job.message.job_id)
        logger.warning("released %d job(s) for redelivery: %s", len(jobs), why)
        self._store.release([job.message.job_id for job in jobs], worker_id=self.worker_id)
        for job in jobs:
            self._pop_inflight(job.message.job_id)

    def _take_record(
        self, tp: TopicPartition, record: ConsumerRecord, candidates: dict[str, Candidate]
    ) -> None:
        """Decode a prefetched record into `candidates`, or settle it if it needs no start."""
        if not self._tracker.owns(tp):
            return  # its partition moved during a rebalance; the new owner has it
        try:
            message = JobMessage.decode(record.value)
        except ValueError as e:
            logger.warning(
                "skipping malformed record %s/%d@%d: %s", tp.topic, tp.partition, record.offset, e
            )
            self._ack({(tp, record.offset)})
            return
        place_record(message, (tp, record.offset), inflight=self._inflight,
                     candidates=candidates, held=self._held)

    def _store_finished(self) -> None:
        """Store what finished, unless the database is away and not due for a try."""
        if not self._unstored or not self._database.may_try():
            return
        try:
            self._handle_finished(self._unstored)
        except SQLAlchemyError as e:
            self._database.failed(e, doing="storing results")
            return
        self._database.succeeded()
        self._unstored = []

    def _handle_finished(self, finished: list[FinishedRequest]) -> None:
        """Store how these requests ended (successes in one transaction), then ack them and
        forget them. Raises on a database error with nothing forgotten: a second call with
        the same requests stores what is missing (the writes are idempotent)."""
        successes: list[tuple[JobMessage, RequestOutput | RemoteOutput, datetime]] = []
        choices: dict[str, list[RequestOutput]] = {}  # of the jobs with n > 1
        settled: list[set[tuple[TopicPartition, int]]] = []
        cancelled: list[str] = []  # their priorities, counted once all is stored
        for done in finished:
            job = self._inflight.get(done.request_id)
            if job is None:
                continue
            if job.is_released:
                # Stays unacknowledged: Kafka redelivers it (here or elsewhere), unless a
                # copy fetched again meanwhile waited for this abort to start it here.
                if (again := self._held.take(done.request_id)) is not None:
                    self._unstarted[done.request_id] = again
                continue
            aborted = done.aborted or (
                done.output is not None and done.output.finish_reason == "abort"
            )
            if aborted and job.is_cancelled:
                cancelled.append(job.message.priority)
            elif aborted or done.error is not None or done.output is None:
                self._outcomes.failed(job.message, done.error or "the engine aborted the request")
            else:
                successes.append((job.message, done.output, job.created_at))
                if done.choices is not None:
                    choices[done.request_id] = done.choices
                settled.append(job.records)
                continue
            if self._store.semantic is not None:
                self._store.semantic.forget(job.message.job_id)
            settled.append(job.records)
        if successes:
            self._outcomes.succeeded(successes, choices)
        gone = [job for done in finished
                if (job := self._pop_inflight(done.request_id)) is not None]
        self._wake_drained_batches(gone)
        for priority in cancelled:
            metrics.JOBS_CANCELLED.labels(priority).inc()
        for records in settled:
            self._ack(records)

    def _wake_drained_batches(self, gone: list[InFlightJob]) -> None:
        """Ask for a batch pass for each batch whose last held job just left (see
        batch_drain); nothing while Redis is away (the pass still comes on its interval)."""
        if self._is_redis_down or not gone:
            return
        drained = self._drains.drained(
            (job.message.batch_id for job in gone),
            (job.message.batch_id for job in self._inflight.values()), time.monotonic())
        self._store.wake_batches(drained)

    def _handle_cancels(self) -> None:
        try:
            job_ids = self._cancels.poll(0.0)
        except redis.RedisError as e:
            # Polled every loop: say it once per outage, not twenty times a second.
            if not self._is_redis_down:
                logger.warning("cannot read cancellations from Redis (%s); retrying", e)
            self._is_redis_down = True
            return
        if self._is_redis_down:
            logger.info("reading cancellations from Redis again")
            self._is_redis_down = False
        for job_id in job_ids:
            job = self._inflight.get(job_id)
            if job is not None and not job.is_cancelled:
                logger.info("cancelling job %s", job_id)
                job.is_cancelled = True
                self._engine.abort(job_id)
        self._handle_follows()

    def _handle_follows(self) -> None:
        """Stream followed jobs: at once if in flight, else when they start (if soon)."""
        follows = self._cancels.take_follows()
        if not follows:
            return
        now = time.monotonic()
        # Pruned when follows come (rare), not every loop: the ones of jobs another
        # worker started are never popped here.
        self._follows = {job_id: until for job_id, until in self._follows.items()
                         if until > now}
        for job_id in follows:
            if job_id in self._inflight:
                self._engine.watch(job_id)
            else:
                self._follows[job_id] = now + FOLLOW_MEMORY_S

    def _is_followed(self, job_id: str) -> bool:
        until = self._follows.pop(job_id, None)
        return until is not None and until > time.monotonic()

    def _on_new_assignment(self) -> bool:
        """After a rebalance: restart from committed offsets, release moved jobs; True if any."""
        assignment = self._listener.take_new_assignment()
        if assignment is None:
            return False
        self._prefetch.clear()
        self._unstarted = {}  # fetched again from the committed offsets
        self._held.clear()
        self._restart_from_committed(assignment)
        self._watchdog.on_assigned(assignment)
        moved: list[str] = []
        for job in self._inflight.values():
            if not job.is_released and not any(tp in assignment for tp, _ in job.records):
                # Its partition now belongs to another worker, which will run it again.
                job.is_released = True
                self._engine.abort(job.message.job_id)
                moved.append(job.message.job_id)
        if moved:
            # Queued again, not left running under this worker: should the new owner never
            # see the record (a broker that lost it), the reconciler re-publishes the job.
            self._store.release(moved, worker_id=self.worker_id)
            logger.info("released %d job(s) whose partitions moved", len(moved))
        return True

    def _restart_from_committed(self, assignment: set[TopicPartition]) -> None:
        # The offset state restarted with the assignment, but kafka-python keeps the fetch
        # position of a partition it still owns. Were it to go on from there, a job in
        # flight at an earlier offset would never be tracked again and the commit point
        # could pass it. So every partition restarts where a new owner would: jobs still
        # in flight re-attach to their records, finished ones are skipped.
        for tp in assignment:
            committed = self._consumer.committed(tp)
            if committed is None:
                self._consumer.seek_to_beginning(tp)
            else:
                self._consumer.seek(tp, committed)

    def _ack(self, records: set[tuple[TopicPartition, int]]) -> None:
        with self._lock:
            for tp, offset in records:
                self._tracker.ack(tp, offset)

    def _commit(self) -> None:
        with self._lock:
            points = self._tracker.committable()
        if not points:
            return
        try:
            self._consumer.commit(offsets_to_commit(points))
        except KafkaError as e:
            logger.warning("offset commit failed (%s); will retry with the next commit", e)
            return
        with self._lock:
            self._tracker.mark_committed(points)
