"""The batch loop meets a batch it cannot handle: that batch fails with a reason, the loop
goes on, and nothing is retried forever or logged once a pass.

A line nested 100,000 deep once raised RecursionError in validation on every pass: the
batch stayed `validating`, its whole file was read again each second with a traceback
each time, and its client heard nothing.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy.exc
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from scheduler.batches import MAX_UNEXPECTED_PASSES, BatchRunner
from storage.batch_jobs import count_batch_jobs
from storage.batches import Batch, BatchStatus
from storage.files import FilePurpose, FileStore, create_file
from storage.models import Tenant, utcnow
from tests.unit.storage.test_batch_expiry import FakeRedis
from tests.unit.storage.test_batches import add_jobs, new_batch

MODEL = "tiny"
LINE = {"custom_id": "r0", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}


def _runner(sessions: sessionmaker[Session], tmp_path: Path) -> tuple[BatchRunner, FileStore]:
    store = FileStore(tmp_path / "files")
    settings = Settings(data_dir=tmp_path, served_models=[MODEL])
    runner = BatchRunner(settings, sessions, producer=None,  # type: ignore[arg-type]
                         redis_client=FakeRedis(), store=store)  # type: ignore[arg-type]
    return runner, store


def _input_file(session: Session, tenant: Tenant, store: FileStore, lines: list[bytes],
                file_id: str) -> str:
    with store.writer(file_id) as writer:
        writer.write(b"\n".join(lines) + b"\n")
        num_bytes = writer.commit()
    create_file(session, file_id=file_id, tenant_id=tenant.id, filename="in.jsonl",
                purpose=FilePurpose.BATCH.value, num_bytes=num_bytes)
    session.commit()
    return file_id


def _status(sessions: sessionmaker[Session], batch_id: str) -> tuple[BatchStatus, list]:
    with sessions() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        return batch.status, list(batch.errors or [])


def test_a_line_nested_100000_deep_fails_validation_naming_its_line(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
) -> None:
    runner, store = _runner(sessions, tmp_path)
    deep = (b'{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", '
            b'"body": {"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
            b'"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}")
    file_id = _input_file(session, tenant, store, [json.dumps(LINE).encode(), deep],
                          "file-deep")
    batch = new_batch(session, tenant, input_file_id=file_id)
    session.commit()
    runner.step()
    status, errors = _status(sessions, batch.id)
    assert status is BatchStatus.FAILED
    [error] = errors
    assert error["line"] == 2
    assert error["code"] == "invalid_json_line"
    assert "deeper than" in error["message"]


def test_an_unexpected_error_in_validation_fails_the_batch_at_once(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner, store = _runner(sessions, tmp_path)
    file_id = _input_file(session, tenant, store, [json.dumps(LINE).encode()], "file-ok")
    batch = new_batch(session, tenant, input_file_id=file_id)
    session.commit()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug at /srv/secret/path")

    monkeypatch.setattr("scheduler.batches.validate_input", broken)
    runner.step()
    status, errors = _status(sessions, batch.id)
    assert status is BatchStatus.FAILED
    [error] = errors
    assert error["code"] == "internal_error"
    assert "RuntimeError" in error["message"]
    assert "/srv/secret" not in error["message"]  # the kind, never the text of the error


def _running(session: Session, tenant: Tenant, num_jobs: int) -> tuple[Batch, list[str]]:
    batch = new_batch(session, tenant, expires_at=utcnow() + timedelta(hours=1))
    job_ids = add_jobs(session, batch, num_jobs)
    batch.move_to(BatchStatus.IN_PROGRESS)
    session.commit()
    return batch, job_ids


def test_a_batch_that_fails_every_pass_is_failed_and_the_others_go_on(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    runner, _ = _runner(sessions, tmp_path)
    stuck, _ = _running(session, tenant, 2)
    other, _ = _running(session, tenant, 0)
    run = BatchRunner._run

    def run_unless_stuck(self: BatchRunner, batch_id: str, *, is_past_window: bool,
                         room: int | None) -> int:
        if batch_id == stuck.id:
            raise KeyError("a bug")
        return run(self, batch_id, is_past_window=is_past_window, room=room)

    monkeypatch.setattr(BatchRunner, "_run", run_unless_stuck)
    with caplog.at_level(logging.ERROR, logger="scheduler.batches"):
        for _ in range(MAX_UNEXPECTED_PASSES - 1):
            runner.step()
            assert _status(sessions, stuck.id)[0] is BatchStatus.IN_PROGRESS
        assert _status(sessions, other.id)[0] is BatchStatus.COMPLETED
        runner.step()
    status, errors = _status(sessions, stuck.id)
    assert status is BatchStatus.FAILED
    assert "KeyError" in errors[0]["message"]
    with sessions() as s:
        counts = count_batch_jobs(s, batch_id=stuck.id)
    assert counts.num_unfinished == 0  # its queued jobs were stopped with it
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]
    assert runner.step() == 0


def test_a_dependency_outage_is_retried_and_never_fails_a_batch(
    sessions: sessionmaker[Session], session: Session, tenant: Tenant, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    runner, _ = _runner(sessions, tmp_path)
    batch, _ = _running(session, tenant, 1)

    def down(self: BatchRunner, batch_id: str, *, is_past_window: bool,
             room: int | None) -> int:
        raise sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("connection refused"))

    monkeypatch.setattr(BatchRunner, "_run", down)
    with caplog.at_level(logging.ERROR, logger="scheduler.batches"):
        for _ in range(MAX_UNEXPECTED_PASSES * 2):
            runner.step()
    assert _status(sessions, batch.id)[0] is BatchStatus.IN_PROGRESS
    assert len([r for r in caplog.records if r.exc_info]) == 1
