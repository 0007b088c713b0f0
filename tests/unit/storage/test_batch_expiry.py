"""The batch loop past a batch's window: what finished stays, the rest is `batch_expired`.

An expiry takes several transactions (stop the jobs, write the files, change status); a
pass that dies between them, or another scheduler's pass in between, must carry on the
expiry rather than read the stopped jobs as a finished batch.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

import scheduler.batches
from core.settings import Settings
from scheduler.batches import BatchRunner
from storage.batch_jobs import count_batch_jobs
from storage.batches import Batch, BatchStatus
from storage.files import FileStore
from storage.jobs import cancel_job, complete_job
from storage.models import Tenant, utcnow
from tests.unit.storage.test_batches import add_jobs, new_batch


class FakeRedis:
    """What the runner publishes (cancels, batch done), kept rather than sent."""

    def __init__(self) -> None:
        self.published: list[tuple[str, str]] = []

    def publish(self, channel: str, payload: str) -> int:
        self.published.append((channel, payload))
        return 0

    def register_script(self, script: str) -> Any:
        """The token budgets' scripts: never run here (no tenant has a budget)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("a token budget script ran without a budget")

        return run


def _runner(sessions: sessionmaker[Session], tmp_path: Path) -> tuple[BatchRunner, FileStore]:
    store = FileStore(tmp_path / "files")
    runner = BatchRunner(Settings(data_dir=tmp_path), sessions, producer=None,  # type: ignore[arg-type]
                         redis_client=FakeRedis(), store=store)  # type: ignore[arg-type]
    return runner, store


def _running_batch(session: Session, tenant: Tenant, num_jobs: int) -> tuple[Batch, list[str]]:
    """An in_progress batch, fully fanned out, whose window is still open."""
    batch = new_batch(session, tenant, completion_window="1h",
                      expires_at=utcnow() + timedelta(hours=1))
    job_ids = add_jobs(session, batch, num_jobs)
    batch.move_to(BatchStatus.IN_PROGRESS)
    session.commit()
    return batch, job_ids


def _succeed(session: Session, job_id: str) -> None:
    complete_job(session, job_id=job_id, result={"object": "chat.completion"},
                 prompt_tokens=1, completion_tokens=1, cached_tokens=0, first_token_at=None)
    session.commit()


def _close_window(session: Session, batch: Batch) -> None:
    batch.expires_at = utcnow()
    session.commit()


def _lines(store: FileStore, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(line) for line in store.path(file_id).read_text().splitlines()]


def test_an_expiry_cut_short_is_finished_as_an_expiry(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner, store = _runner(sessions, tmp_path)
    batch, job_ids = _running_batch(session, tenant, 3)
    _succeed(session, job_ids[0])
    _close_window(session, batch)

    def dies(*args: object, **kwargs: object) -> None:
        raise RuntimeError("scheduler killed while writing the files")

    with monkeypatch.context() as patch:
        patch.setattr(scheduler.batches, "write_result_files", dies)
        with pytest.raises(RuntimeError):
            runner.advance(batch.id)
    session.expire_all()
    # The jobs were stopped, the batch not yet expired: every job has finished now.
    assert batch.status is BatchStatus.IN_PROGRESS
    assert count_batch_jobs(session, batch_id=batch.id).num_unfinished == 0

    runner.advance(batch.id)
    session.expire_all()
    assert batch.status is BatchStatus.EXPIRED and batch.expired_at is not None
    assert batch.completed_at is None and batch.finalizing_at is None
    assert (batch.num_completed, batch.num_failed) == (1, 2)
    assert [x["custom_id"] for x in _lines(store, batch.output_file_id)] == ["r0"]
    errors = _lines(store, batch.error_file_id)
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
        ("r1", "batch_expired"), ("r2", "batch_expired")]


def test_a_batch_that_finished_in_its_window_completes_even_if_seen_after_it(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
) -> None:
    runner, store = _runner(sessions, tmp_path)
    batch, job_ids = _running_batch(session, tenant, 3)
    _succeed(session, job_ids[0])
    _succeed(session, job_ids[1])
    # Cancelled on its own (the jobs API) while the window was open.
    cancel_job(session, job_id=job_ids[2], tenant_id=tenant.id)
    session.commit()
    _close_window(session, batch)

    runner.advance(batch.id)
    session.expire_all()
    assert batch.status is BatchStatus.COMPLETED and batch.expired_at is None
    assert (batch.num_completed, batch.num_failed) == (2, 1)
    [error] = _lines(store, batch.error_file_id)
    assert (error["custom_id"], error["error"]["code"]) == ("r2", "request_cancelled")
