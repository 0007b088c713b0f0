"""One test's slice of the real services for worker tests: settings, database, producer, workers.

`Service` writes jobs as the API does (rows first, then records), starts worker processes
and reads results back; `job_bodies` makes distinct greedy requests.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from core.kafka import make_producer, publish_job
from core.settings import Settings
from storage import jobs
from storage.job_messages import job_message
from storage.models import Job, JobStatus
from tests.utils.budget import within_budget
from tests.utils.service import WorkerProcess


@dataclass
class Service:
    """Settings, database sessions and a producer for one test, plus its workers."""

    settings: Settings
    sessions: sessionmaker[Session]
    tenant_id: str
    tmp_path: Path
    workers: list[WorkerProcess]

    def submit(
        self,
        priority: str,
        bodies: list[dict[str, Any]],
        *,
        spread: bool = False,
        batched: bool = False,
        kind: str | None = None,
    ) -> list[str]:
        """Create queued jobs, then produce them (the API's order); their ids.

        `spread` puts them on the partitions in turn instead of by affinity key; `batched`
        lets the producer put several records in one batch, as the API's does (lag counts
        on the embedded broker are then off). `kind`: the jobs' kind (by default, each
        body's: chat with `messages`, else text).
        """
        with self.sessions() as session:
            rows = [
                jobs.create_job(
                    session,
                    tenant_id=self.tenant_id,
                    priority=priority,
                    model=self.settings.served_model_name,
                    kind=kind or kind_of(body),
                    request=body,
                )
                for body in bodies
            ]
            jobs.mark_published(session, job_ids=[r.id for r in rows])
            session.commit()
            messages = [job_message(r) for r in rows]
        # One record per request unless asked: lag assertions count records on the
        # embedded broker, which counts a batch as one.
        producer = make_producer(self.settings, **({} if batched else {"batch_size": 0}))
        try:
            topic, num_partitions = (
                self.settings.job_topics[priority],
                self.settings.topic_partitions,
            )
            futures = [
                producer.send(
                    topic, key=m.affinity_key(), value=m.encode(), partition=i % num_partitions
                )
                if spread
                else publish_job(producer, self.settings, m)
                for i, m in enumerate(messages)
            ]
            for future in futures:
                future.get(timeout=30)
        finally:
            producer.close()
        return [m.job_id for m in messages]

    def start_worker(self) -> WorkerProcess:
        """Start one more worker process."""
        log = self.tmp_path / f"worker-{len(self.workers)}.log"
        worker = WorkerProcess(self.settings, log)
        self.workers.append(worker)
        return worker

    def jobs(self, job_ids: list[str]) -> dict[str, Job]:
        """Fresh rows for these ids."""
        with self.sessions() as session:
            rows = session.scalars(sa.select(Job).where(Job.id.in_(job_ids))).all()
            return {row.id: row for row in rows}

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 120.0) -> None:
        """Poll `check` until true; fail with the workers' logs after `timeout`."""
        deadline = time.monotonic() + within_budget(timeout)
        while not check():
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {w.log_path.name}\n{w.log_tail()}" for w in self.workers)
                pytest.fail(f"timed out waiting for {what}\n{logs}")
            time.sleep(0.2)

    def freeze_when(self, worker: WorkerProcess, what: str, job_ids: list[str],
                    check: Callable[[dict[str, Job]], bool],
                    timeout: float = 120.0) -> dict[str, Job]:
        """SIGSTOP `worker` at a moment its jobs' rows satisfy `check`; those rows.

        A state seen while the worker runs may be gone by the next line of the test (a
        running job finishes, the next is not yet claimed), so the check is made again on
        the frozen worker, and the worker let go to run on until it holds.
        """
        deadline = time.monotonic() + within_budget(timeout)
        while True:
            if check(self.jobs(job_ids)):
                os.kill(worker.pid, signal.SIGSTOP)
                # A commit sent just before the stop may still be landing.
                time.sleep(0.3)
                frozen = self.jobs(job_ids)
                if check(frozen):
                    return frozen
                os.kill(worker.pid, signal.SIGCONT)
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}\n{worker.log_tail()}")
            time.sleep(0.05)

    def wait_terminal(self, job_ids: list[str], timeout: float = 180.0) -> dict[str, Job]:
        """Wait until every job is finished; their rows."""
        self.wait_for(
            f"{len(job_ids)} jobs to finish",
            lambda: all(j.status.is_terminal for j in self.jobs(job_ids).values()),
            timeout,
        )
        return self.jobs(job_ids)

    def run_succeeded(self, bodies: list[dict[str, Any]], *,
                      priority: str = "high") -> list[Job]:
        """Submit the bodies, wait for them, assert each succeeded; their rows in order."""
        job_ids = self.submit(priority, bodies)
        done = self.wait_terminal(job_ids)
        finished = [done[job_id] for job_id in job_ids]
        assert all(j.status == JobStatus.SUCCEEDED for j in finished), [j.error for j in finished]
        return finished

    def count_status(self, job_ids: list[str], status: JobStatus) -> int:
        """How many of these jobs are in `status`."""
        return sum(j.status == status for j in self.jobs(job_ids).values())


def kind_of(body: dict[str, Any]) -> Literal["chat.completion", "text_completion"]:
    return "chat.completion" if "messages" in body else "text_completion"


def job_bodies(n: int, *, tag: str, max_tokens: int, **extra: Any) -> list[dict[str, Any]]:
    """Distinct greedy requests (distinct, so no result-cache hits), chat and text mixed."""
    bodies = []
    for i in range(n):
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, **extra}
        if i % 2:
            body["messages"] = [{"role": "user", "content": f"{tag} question {i}"}]
        else:
            body["prompt"] = f"{tag} prompt number {i}:"
        bodies.append(body)
    return bodies
