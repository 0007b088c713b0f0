"""The service a batch test drives: API, scheduler and worker processes on real backends.

Each role runs as its own process, as deployed: the API (`batchinfer api`, so its memory
can be measured alone), the scheduler (`batchinfer reconcile`: reconciler + batch loop)
and one inference worker on a tiny random-weight model. PostgreSQL, Redis and the broker
come from the integration fixtures.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import sqlalchemy as sa
from openai import OpenAI
from openai.types import Batch
from sqlalchemy.orm import Session, sessionmaker

from core.kafka import ensure_topics
from core.settings import Settings
from scheduler.embedded_services import free_port
from storage.batches import Batch as BatchRow
from storage.db import create_db_engine, session_factory
from storage.deliveries import list_deliveries
from storage.migrate import upgrade
from storage.models import Job, JobStatus
from tests.utils.api import make_tenant_key
from tests.utils.budget import within_budget
from tests.utils.cli_process import CliProcess
from tests.utils.service import WorkerProcess

CHAT: Final = "/v1/chat/completions"
TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class BatchService:
    """A running service and what a test needs to talk to it and inspect it."""

    settings: Settings
    url: str
    api_key: str
    tenant_id: str
    sessions: sessionmaker[Session]
    api: CliProcess
    scheduler: CliProcess
    worker_log: Path
    # None until start_worker(): batch_service(start_worker=False) starts none.
    worker: WorkerProcess | None = None

    def start_worker(self) -> WorkerProcess:
        """Start the inference worker and wait until it consumes its partitions."""
        assert self.worker is None, "the worker runs already"
        self.worker = WorkerProcess(self.settings, self.worker_log)
        _wait_worker_assigned(self.worker)
        return self.worker

    def api_rss_settled(self, timeout: float = 300.0) -> int:
        """The API's resident bytes once its start-up work is done: it loads each served
        model's tokenizer (and transformers) on a thread after it answers, ~100 MiB that
        a baseline taken before would count as growth."""
        deadline = time.monotonic() + within_budget(timeout)
        while "core.model_context" not in self.api.log_tail(200_000):
            if time.monotonic() > deadline:
                raise AssertionError(f"the API loaded no model context in {timeout}s\n"
                                     f"{self.logs()}")
            time.sleep(0.1)
        return self.api.rss_bytes

    def openai(self) -> OpenAI:
        """The official client, pointed at this service."""
        return OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0)

    def logs(self) -> str:
        """The tails of every role's log, for failure messages."""
        return "\n".join(f"--- {name}\n{tail}" for name, tail in (
            ("api", self.api.log_tail()), ("scheduler", self.scheduler.log_tail()),
            ("worker", self.worker.log_tail() if self.worker else "(not started)")))

    def wait_batch(self, client: OpenAI, batch_id: str, until: Callable[[Batch], bool],
                   timeout: float = 300.0) -> Batch:
        """Poll the batch until `until(batch)`; fail with the logs after `timeout`."""
        deadline = time.monotonic() + within_budget(timeout)
        while True:
            batch = client.batches.retrieve(batch_id)
            if until(batch):
                return batch
            if time.monotonic() > deadline:
                raise AssertionError(f"batch {batch_id} still {batch.status} "
                                     f"({batch.request_counts}) after {timeout}s\n{self.logs()}")
            time.sleep(0.25)

    def webhook_events(self, batch_id: str) -> list[tuple[str, str, dict[str, Any]]]:
        """(event type, url, payload) of each webhook delivery stored for the batch."""
        with self.sessions() as session:
            return [(d.event_type, d.url, d.payload) for d in list_deliveries(
                session, tenant_id=self.tenant_id, batch_id=batch_id)]

    def job_statuses(self, batch_id: str) -> dict[JobStatus, int]:
        """How many of the batch's jobs are in each status, from the database."""
        with self.sessions() as session:
            rows = session.execute(sa.select(Job.status, sa.func.count())
                                   .where(Job.batch_id == batch_id).group_by(Job.status))
            return {JobStatus(status): count for status, count in rows}

    def wait_jobs(self, batch_id: str, until: Callable[[dict[JobStatus, int]], bool],
                  timeout: float = 120.0) -> dict[JobStatus, int]:
        """Poll job_statuses(batch_id) until `until(statuses)`; fail with the logs."""
        deadline = time.monotonic() + within_budget(timeout)
        while not until(statuses := self.job_statuses(batch_id)):
            if time.monotonic() > deadline:
                raise AssertionError(f"batch {batch_id}: jobs still {statuses} after "
                                     f"{timeout}s\n{self.logs()}")
            time.sleep(0.05)
        return statuses

    def wait_published(self, batch_id: str, num_jobs: int, timeout: float = 120.0) -> None:
        """Wait until `num_jobs` of the batch's jobs are in the broker, not only queued in
        the database: the fan-out commits a chunk's jobs before it produces them (and
        stamps `queued_at` once the broker acknowledged), so a worker started at "queued"
        can find some batches' records there and others' a poll later."""
        deadline = time.monotonic() + within_budget(timeout)
        while True:
            with self.sessions() as session:
                num = session.scalar(sa.select(sa.func.count()).where(
                    Job.batch_id == batch_id, Job.status == JobStatus.QUEUED,
                    Job.queued_at.is_not(None)))
            if num == num_jobs:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"batch {batch_id}: {num} of {num_jobs} jobs published "
                                     f"after {timeout}s\n{self.logs()}")
            time.sleep(0.05)

    def set_expires_at(self, batch_id: str, at: datetime) -> None:
        """Move the batch's deadline: the test's clock for when its window ends."""
        with self.sessions() as session:
            session.execute(sa.update(BatchRow).where(BatchRow.id == batch_id)
                            .values(expires_at=at))
            session.commit()


@contextmanager
def batch_service(make_settings: Callable[..., Settings], tmp_path: Path, model_dir: Path,
                  *, start_worker: bool = True, **overrides: Any) -> Iterator[BatchService]:
    """Start the three roles on migrated PostgreSQL; stop them (and check exits) after.

    With `start_worker=False` only the API and the scheduler run: batches validate and
    fan out but no request finishes until the test calls `service.start_worker()`.
    """
    values: dict[str, Any] = {
        "model": str(model_dir), "topic_partitions": 2, "kafka_session_timeout_ms": 6000,
        "batch_poll_interval_s": 0.3, "batch_completion_windows": ["24h", "8s"],
        "engine_kv_cache_memory_bytes": 64 * 1024 * 1024, "log_level": "INFO",
        "webhook_allowlist": ["127.0.0.1"],
    }
    values.update(overrides)
    settings = make_settings(**values)
    upgrade(settings.database_url)
    ensure_topics(settings)
    engine = create_db_engine(settings.database_url)
    sessions = session_factory(engine)
    tenant = make_tenant_key(sessions, "batch-tests")
    port = free_port()
    scheduler = CliProcess(["reconcile"], settings, tmp_path / "scheduler.log")
    api = CliProcess(["api", "--host", "127.0.0.1", "--port", str(port)], settings,
                     tmp_path / "api.log")
    service = BatchService(settings=settings, url=f"http://127.0.0.1:{port}",
                           api_key=tenant.key, tenant_id=tenant.tenant_id, sessions=sessions,
                           api=api, scheduler=scheduler, worker_log=tmp_path / "worker.log")
    try:
        if start_worker:
            service.start_worker()
        api.wait_http(f"{service.url}/healthz")
        yield service
    finally:
        codes = {"api": api.stop(), "scheduler": scheduler.stop(),
                 "worker": service.worker.stop() if service.worker else 0}
        engine.dispose()
    # uvicorn re-raises SIGTERM after its graceful shutdown, so the API's clean exit is -15.
    assert codes["api"] in (0, -15) and codes["scheduler"] == codes["worker"] == 0, (
        f"exit codes {codes}\n{service.logs()}")


def _wait_worker_assigned(worker: WorkerProcess, timeout: float = 180.0) -> None:
    """Wait until the worker's consumer holds partitions (its log says so)."""
    deadline = time.monotonic() + within_budget(timeout)
    while "partitions assigned: ['" not in worker.log_tail(200_000):
        if worker.process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"worker not consuming:\n{worker.log_tail()}")
        time.sleep(0.2)


def chat_line(custom_id: str, model: str, *, content: str = "Say hi.", max_tokens: int = 2,
              **body: Any) -> dict[str, Any]:
    """One input line for /v1/chat/completions."""
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": model, "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0, **body}}


def jsonl(items: Sequence[dict[str, Any] | str]) -> bytes:
    """A JSONL file's bytes: dicts encoded, strings written as they are."""
    return "".join((i if isinstance(i, str) else json.dumps(i)) + "\n" for i in items).encode()


def parse_jsonl(content: bytes) -> list[dict[str, Any]]:
    """Every line of a JSONL file."""
    return [json.loads(line) for line in content.splitlines() if line.strip()]
