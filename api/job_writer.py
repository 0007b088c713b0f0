"""Grouped admission: concurrent submissions share one commit and one round trip to the broker.

Responsible for: taking validated, admitted job rows from request threads, and on one
writer thread storing every row that arrived within a short window in one transaction,
producing their records together and waiting for the acknowledgements together, then
answering each request: its job, or the reason it was refused.

Why: a job per transaction and a synchronous produce per request cost two commits and a
broker round trip each, which capped the API at ~140 submissions/s. Grouped, the commit
and the round trip are shared by every request that arrived meanwhile (32 in flight share
one), and a request waits at most QUIET_S longer when it arrives alone (WINDOW_S when
others keep arriving).

The promises of `api.submission` hold for each request of a group:
- nothing is written for a refused request: validation and admission ran before it got
  here, and a row whose record the broker did not acknowledge is deleted again (if still
  queued) before its request hears 503;
- an Idempotency-Key taken by a concurrent request fails only that request's insert (the
  group is retried row by row), which then answers as a replay;
- a row is committed before its record is produced, so a crash in between leaves a queued
  job the reconciler re-publishes: exactly one result either way. Rows are stamped
  published when stored (`queued_at`): had they been stamped after the ack, the
  reconciler's clock would read the same, and it costs a second commit;
- a commit that raises may still have reached the database (PostgreSQL dying mid-COMMIT
  keeps what its log holds): its requests hear 503, and their rows, never produced, are
  withdrawn as soon as the database answers again (tried every DOUBTFUL_RETRY_S on the
  writer thread), not left queued until the reconciler re-publishes them minutes later.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from kafka import KafkaProducer
from kafka.errors import KafkaError
from sqlalchemy import delete
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from api.broker_errors import ServiceStopping
from core.kafka import publish_job
from core.settings import Settings
from storage.job_messages import job_message
from storage.jobs import IdempotencyKeyTaken, insert_new_jobs
from storage.models import Job, JobStatus

logger = logging.getLogger(__name__)

# How long the writer waits for more submissions after the first of a group arrives, at
# most; it stops sooner once none has arrived for QUIET_S. Submissions that come together
# (a client's concurrent requests answered together come back together) arrive tens of
# microseconds apart, and the writer often sees them only once all are in: waiting out
# the whole window then held every one of them ~2 ms for nothing (of a ~15 ms cycle at
# 32 in flight, measured).
WINDOW_S = 0.002
QUIET_S = 0.0003
# Rows stored and produced per group, at most.
MAX_GROUP = 256
# Groups whose acks are awaited at once (each waits at most the publish timeout).
NUM_ACK_WAITERS = 4
# How long a request waits for its group to be written (a broker ack is bounded far below).
WRITE_TIMEOUT_S = 60.0
# Seconds between tries to withdraw the rows of a commit that raised (see _insert).
DOUBTFUL_RETRY_S = 1.0


class ProducerHandle(Protocol):
    """What the writer needs of `api.resources.LazyProducer`: the connected producer, and
    the one step in which a job is checked against a stop and accepted."""

    def get(self) -> KafkaProducer:
        """The producer; raises (BrokerUnavailable) when jobs cannot be handed over now."""
        ...

    def accepting(self) -> AbstractContextManager[str | None]:
        """Held while answering: None if jobs may be accepted, else why not (stopping)."""
        ...


@dataclass(slots=True)
class _Pending:
    job: Job
    producer: ProducerHandle
    answer: Future[Job] = field(default_factory=Future)


class JobWriter:
    """One writer thread storing and producing submissions in groups (see module docstring).

    `publish_timeout_s` bounds the wait for a group's acknowledgements.
    """

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        *,
        publish_timeout_s: float,
        window_s: float = WINDOW_S,
        quiet_s: float = QUIET_S,
        max_group: int = MAX_GROUP,
    ) -> None:
        self._settings = settings
        self._sessions = sessions
        self._publish_timeout_s = publish_timeout_s
        self._window_s = window_s
        self._quiet_s = quiet_s
        self._max_group = max_group
        self._inbox: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._ackers = ThreadPoolExecutor(NUM_ACK_WAITERS, thread_name_prefix="job-acks")
        # Ids of refused jobs whose commit raised and so may have stored them anyway, in
        # the order refused; changed on the writer thread only, read by `is_doubtful`.
        self._doubtful: dict[str, None] = {}
        self._next_withdrawal_at = 0.0

    def write(self, job: Job, producer: ProducerHandle) -> Job:
        """Store and produce a new queued job; raises what refused it (see module docstring).

        Raises IdempotencyKeyTaken when a concurrent request holds the key, the broker's
        error (BrokerUnavailable, KafkaError) when the record was not acknowledged, a
        SQLAlchemyError when the database refused the group.
        """
        producer.get()  # a broker known to be down refuses at once, not behind a group
        return self.enqueue(job, producer).result(timeout=WRITE_TIMEOUT_S)

    def is_doubtful(self, job_id: str) -> bool:
        """Whether `job_id` was refused after a commit that raised and its row, should
        that commit have stored it after all, is not withdrawn yet: such a row is no job,
        and a replay of its Idempotency-Key must not answer with it."""
        return job_id in self._doubtful

    def enqueue(self, job: Job, producer: ProducerHandle) -> Future[Job]:
        """Hand a job to the writer without waiting: its answer comes as `write`'s would.

        For the event loop (`asyncio.wrap_future`): it never blocks, so the producer is
        asked for only on the writer thread, where a broker known to be down refuses the
        group before anything is written.
        """
        if self._closed.is_set():
            raise RuntimeError("the job writer is closed")
        pending = _Pending(job, producer)
        self._inbox.put(pending)
        self._start()
        return pending.answer

    def close(self) -> None:
        """Finish the groups already taken, then stop the writer thread."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(WRITE_TIMEOUT_S)
        self._ackers.shutdown(wait=True)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="job-writer", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not (self._closed.is_set() and self._inbox.empty()):
            self._withdraw_doubtful()
            try:
                first = self._inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            group = [first]
            deadline = time.monotonic() + self._window_s
            while len(group) < self._max_group:
                remaining = min(deadline - time.monotonic(), self._quiet_s)
                try:
                    group.append(self._inbox.get(timeout=remaining) if remaining > 0
                                 else self._inbox.get_nowait())
                except queue.Empty:
                    break
            try:
                # One app has one producer; tests may give each app its own stand-in.
                for handle in {id(p.producer): p.producer for p in group}.values():
                    self._write_group([p for p in group if p.producer is handle])
            except Exception as e:  # never leave a request waiting on an answer
                logger.exception("writing a group of %d jobs failed", len(group))
                for pending in group:
                    if not pending.answer.done():
                        pending.answer.set_exception(e)
        self._next_withdrawal_at = 0.0  # a last try before the process may end
        self._withdraw_doubtful()
        if self._doubtful:
            logger.warning("%d refused job(s) may be stored by a failed commit; the "
                           "reconciler will run them", len(self._doubtful))

    def _write_group(self, group: list[_Pending]) -> None:
        try:
            kafka = group[0].producer.get()
        except Exception as e:  # BrokerUnavailable: refused before anything is written
            for pending in group:
                pending.answer.set_exception(e)
            return
        stored = self._insert(group)
        deadline = time.monotonic() + self._publish_timeout_s
        sends = []
        unsent: list[tuple[_Pending, Exception]] = []
        for pending in stored:
            try:
                sends.append((pending, publish_job(kafka, self._settings,
                                                   job_message(pending.job))))
            except KafkaError as e:  # refused before sending (buffer full, no metadata)
                unsent.append((pending, e))
        # Acks are awaited off the writer thread: a broker dying mid-group must not hold
        # the groups behind it, which are refused at once once it is known down.
        self._ackers.submit(self._settle, stored, sends, unsent, deadline)

    def _settle(self, stored: list[_Pending], sends: list[tuple[_Pending, Any]],
                unsent: list[tuple[_Pending, Exception]], deadline: float) -> None:
        """Wait for a group's acks; withdraw and refuse what was not taken, answer the rest."""
        try:
            self._settle_acks(stored, sends, unsent, deadline)
        except Exception as e:  # never leave a request waiting on an answer
            logger.exception("settling a group of %d jobs failed", len(stored))
            for pending in stored:
                if not pending.answer.done():
                    pending.answer.set_exception(e)

    def _settle_acks(self, stored: list[_Pending], sends: list[tuple[_Pending, Any]],
                     unsent: list[tuple[_Pending, Exception]], deadline: float) -> None:
        for pending, future in sends:
            try:
                future.get(timeout=max(0.0, deadline - time.monotonic()))
            except KafkaError as e:
                unsent.append((pending, e))
        if unsent:
            logger.warning("%d job(s) not acknowledged by the broker (%s); withdrawing them",
                           len(unsent), unsent[0][1])
            self._withdraw([p.job.id for p, _ in unsent])
            for pending, error in unsent:
                pending.answer.set_exception(error)
        self._accept([p for p in stored if not p.answer.done()])

    def _accept(self, acked: list[_Pending]) -> None:
        """Answer acknowledged jobs: accepted, unless the service began stopping since
        their group was taken, in which case each is withdrawn and refused.

        The check and the answers happen under the producer's `accepting`, which the stop
        (`refuse`) also takes: no job is accepted after the stop. A withdrawn job that a
        worker already took cannot be deleted: it is accepted after all, as it runs.
        """
        if not acked:
            return
        refused: list[tuple[_Pending, str]] = []
        for handle in {id(p.producer): p.producer for p in acked}.values():
            with handle.accepting() as refusal:
                for pending in acked:
                    if pending.producer is not handle:
                        continue
                    if refusal is None:
                        pending.answer.set_result(pending.job)
                    else:
                        refused.append((pending, refusal))
        if not refused:
            return
        withdrawn = self._withdraw([p.job.id for p, _ in refused])
        for pending, reason in refused:
            if pending.job.id in withdrawn:
                pending.answer.set_exception(ServiceStopping(reason))
            else:
                pending.answer.set_result(pending.job)

    def _insert(self, group: list[_Pending]) -> list[_Pending]:
        """Commit the group's rows together; on a key clash, row by row. The ones stored."""
        try:
            with self._sessions() as session:
                insert_new_jobs(session, [p.job for p in group])
                session.commit()
            return group
        except IntegrityError:
            logger.debug("a group of %d clashed on a unique key; storing it row by row",
                         len(group))
        except SQLAlchemyError as e:
            self._doubtful.update(dict.fromkeys(p.job.id for p in group))
            for pending in group:
                pending.answer.set_exception(e)
            return []
        stored = []
        for pending in group:
            try:
                with self._sessions() as session:
                    insert_new_jobs(session, [pending.job])
                    session.commit()
                stored.append(pending)
            except IntegrityError as e:
                key = pending.job.idempotency_key
                pending.answer.set_exception(
                    IdempotencyKeyTaken(f"idempotency key {key!r} is already used") if key
                    else e)
            except SQLAlchemyError as e:
                self._doubtful[pending.job.id] = None
                pending.answer.set_exception(e)
        return stored

    def _withdraw_doubtful(self) -> None:
        """Delete the rows a raising commit may have stored, once the database answers."""
        if not self._doubtful or time.monotonic() < self._next_withdrawal_at:
            return
        num_deleted = 0
        while self._doubtful:
            # In slices: a long outage refuses many, and SQLite bounds a statement's
            # parameters.
            ids = list(islice(self._doubtful, MAX_GROUP))
            try:
                num_deleted += len(self._delete_queued(ids))
            except SQLAlchemyError as e:
                self._next_withdrawal_at = time.monotonic() + DOUBTFUL_RETRY_S
                logger.debug("withdrawing %d refused job(s) must wait for the database: %s",
                             len(self._doubtful), e)
                break
            for job_id in ids:
                del self._doubtful[job_id]
        if num_deleted:
            logger.warning("withdrew %d refused job(s) that their failed commit had stored "
                           "after all", num_deleted)

    def _withdraw(self, job_ids: list[str]) -> set[str]:
        """Delete jobs still queued whose acceptance was refused (the broker did not take
        them, or the service is stopping); the ids deleted."""
        try:
            return self._delete_queued(job_ids)
        except SQLAlchemyError:
            logger.exception("could not withdraw %d unpublished job(s); the reconciler will "
                             "re-publish them", len(job_ids))
            return set()

    def _delete_queued(self, job_ids: list[str]) -> set[str]:
        """Delete these jobs where still queued (none was produced, or a worker took it);
        the ids deleted."""
        with self._sessions() as session:
            deleted = session.scalars(
                delete(Job)
                .where(Job.id.in_(job_ids), Job.status == JobStatus.QUEUED)
                .returning(Job.id)
                .execution_options(synchronize_session=False)
            ).all()
            session.commit()
        return set(deleted)
