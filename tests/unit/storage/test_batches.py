"""Batch rows and their jobs: lifecycle, pagination, counts, stopping, result files."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from openai.types import Batch as OpenAIBatch
from sqlalchemy.orm import Session

from scheduler.batch_results import add_result_file_rows, write_result_files
from storage.batch_jobs import count_batch_jobs, iter_batch_jobs, stop_batch_jobs
from storage.batch_output import BATCH_EXPIRED
from storage.batches import (
    Batch,
    BatchStatus,
    IllegalBatchTransition,
    active_batch_ids,
    batch_object,
    completion_window_seconds,
    create_batch,
    is_file_in_use,
    list_batches,
    request_cancel,
)
from storage.files import FileStore, get_file
from storage.jobs import complete_job, create_job, fail_job, mark_running
from storage.models import Tenant, utcnow

CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def new_batch(session: Session, tenant: Tenant, **overrides: object) -> Batch:
    """A validating batch with test defaults."""
    values: dict[str, object] = {
        "tenant_id": tenant.id, "input_file_id": "file-in", "endpoint": CHAT,
        "completion_window": "24h", "expires_at": utcnow() + timedelta(hours=24),
        "priority": "low",
    }
    values.update(overrides)
    return create_batch(session, **values)  # type: ignore[arg-type]


def add_jobs(session: Session, batch: Batch, num_jobs: int) -> list[str]:
    """Queued jobs for the batch, custom ids r0, r1, ...; returns their ids."""
    ids = [
        create_job(session, tenant_id=batch.tenant_id, priority="low", model="tiny",
                   kind="chat.completion", request=BODY, batch_id=batch.id,
                   custom_id=f"r{i}").id
        for i in range(num_jobs)
    ]
    batch.num_enqueued = batch.num_requests = num_jobs
    session.commit()
    return ids


def test_lifecycle_stamps_each_status_and_refuses_skips(session: Session,
                                                         tenant: Tenant) -> None:
    batch = new_batch(session, tenant)
    assert batch.status is BatchStatus.VALIDATING
    batch.move_to(BatchStatus.IN_PROGRESS)
    batch.move_to(BatchStatus.FINALIZING)
    batch.move_to(BatchStatus.COMPLETED)
    session.commit()
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    with pytest.raises(IllegalBatchTransition, match="completed batch cannot become"):
        batch.move_to(BatchStatus.CANCELLING)
    assert batch.status.is_terminal


def test_cancel_is_idempotent_and_refused_once_finalizing(session: Session,
                                                          tenant: Tenant) -> None:
    batch = new_batch(session, tenant)
    session.commit()
    first = request_cancel(session, batch_id=batch.id, tenant_id=tenant.id)
    assert first is not None and first.status is BatchStatus.CANCELLING
    again = request_cancel(session, batch_id=batch.id, tenant_id=tenant.id)
    assert again is not None and again.cancelling_at == first.cancelling_at
    other = new_batch(session, tenant)
    other.move_to(BatchStatus.IN_PROGRESS)
    other.move_to(BatchStatus.FINALIZING)
    session.commit()
    with pytest.raises(IllegalBatchTransition):
        request_cancel(session, batch_id=other.id, tenant_id=tenant.id)


def test_other_tenants_cannot_cancel(session: Session, tenant: Tenant,
                                     other_tenant: Tenant) -> None:
    batch = new_batch(session, tenant)
    session.commit()
    assert request_cancel(session, batch_id=batch.id, tenant_id=other_tenant.id) is None


def test_list_pages_newest_first_without_gaps(session: Session, tenant: Tenant,
                                              other_tenant: Tenant) -> None:
    ids = [new_batch(session, tenant).id for _ in range(5)]
    new_batch(session, other_tenant)
    session.commit()
    first, has_more = list_batches(session, tenant_id=tenant.id, limit=3)
    assert has_more
    second, has_more = list_batches(session, tenant_id=tenant.id, limit=3, after=first[-1].id)
    assert not has_more
    assert [b.id for b in first + second] == ids[::-1]
    with pytest.raises(ValueError, match="after"):
        list_batches(session, tenant_id=tenant.id, after="batch_nope")


def test_file_in_use_only_while_a_batch_is_active(session: Session, tenant: Tenant) -> None:
    batch = new_batch(session, tenant, input_file_id="file-x")
    session.commit()
    assert is_file_in_use(session, file_id="file-x")
    assert active_batch_ids(session) == [batch.id]
    batch.move_to(BatchStatus.FAILED)
    session.commit()
    assert not is_file_in_use(session, file_id="file-x")
    assert active_batch_ids(session) == []


def test_request_counts_follow_job_statuses(session: Session, tenant: Tenant) -> None:
    batch = new_batch(session, tenant)
    job_ids = add_jobs(session, batch, 6)
    mark_running(session, job_id=job_ids[0], worker_id="w")
    complete_job(session, job_id=job_ids[1], result={"ok": 1}, prompt_tokens=3,
                 completion_tokens=2, cached_tokens=1, first_token_at=None)
    fail_job(session, job_id=job_ids[2], error={"message": "bad"})
    session.commit()
    counts = count_batch_jobs(session, batch_id=batch.id)
    assert (counts.num_queued, counts.num_running, counts.num_succeeded,
            counts.num_failed) == (3, 1, 1, 1)
    assert counts.num_unfinished == 4


def test_stopping_cancels_unfinished_jobs_and_names_the_running(session: Session,
                                                                tenant: Tenant) -> None:
    batch = new_batch(session, tenant)
    job_ids = add_jobs(session, batch, 3)
    mark_running(session, job_id=job_ids[0], worker_id="w")
    complete_job(session, job_id=job_ids[1], result={"ok": 1}, prompt_tokens=1,
                 completion_tokens=1, cached_tokens=0, first_token_at=None)
    session.commit()
    assert stop_batch_jobs(session, batch_id=batch.id) == [job_ids[0]]
    session.commit()
    counts = count_batch_jobs(session, batch_id=batch.id)
    assert (counts.num_succeeded, counts.num_cancelled, counts.num_unfinished) == (1, 2, 0)
    # A late result for a stopped job is refused.
    assert not complete_job(session, job_id=job_ids[0], result={}, prompt_tokens=1,
                            completion_tokens=1, cached_tokens=0, first_token_at=None)


def test_jobs_stream_in_creation_order_across_pages(session: Session, tenant: Tenant) -> None:
    batch = new_batch(session, tenant)
    add_jobs(session, batch, 7)
    rows = list(iter_batch_jobs(session, batch_id=batch.id, page_size=3))
    assert [r.custom_id for r in rows] == [f"r{i}" for i in range(7)]


def test_result_files_hold_one_line_per_request(session: Session, tenant: Tenant,
                                                tmp_path: Path) -> None:
    store = FileStore(tmp_path / "files")
    input_id = "file-input1"
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": BODY})
             for i in range(5)]
    (tmp_path / "files" / input_id).write_text("\n".join(lines) + "\n")
    batch = new_batch(session, tenant, input_file_id=input_id)
    job_ids = add_jobs(session, batch, 3)
    batch.num_requests = 5  # lines r3 and r4 were never enqueued
    complete_job(session, job_id=job_ids[0], result={"object": "chat.completion"},
                 prompt_tokens=1, completion_tokens=1, cached_tokens=0, first_token_at=None)
    fail_job(session, job_id=job_ids[1], error={"message": "bad", "type": "server_error"})
    session.commit()

    files = write_result_files(session, store, batch, stopped_code=BATCH_EXPIRED,
                               max_line_bytes=10_000)
    add_result_file_rows(session, batch, files)
    session.commit()
    assert (batch.num_completed, batch.num_failed) == (1, 4)
    assert batch.output_file_id and batch.error_file_id
    output = [json.loads(x) for x in store.path(batch.output_file_id).read_text().splitlines()]
    errors = [json.loads(x) for x in store.path(batch.error_file_id).read_text().splitlines()]
    assert [x["custom_id"] for x in output] == ["r0"]
    assert [x["custom_id"] for x in errors] == ["r1", "r2", "r3", "r4"]
    assert errors[0]["response"]["status_code"] == 500
    assert [x["error"]["code"] for x in errors[1:]] == [BATCH_EXPIRED] * 3
    stored = get_file(session, file_id=batch.error_file_id, tenant_id=tenant.id)
    assert stored is not None and stored.purpose == "batch_output"
    assert stored.num_bytes == store.path(batch.error_file_id).stat().st_size


def test_batch_object_is_what_the_openai_client_parses(session: Session,
                                                       tenant: Tenant) -> None:
    batch = new_batch(session, tenant, metadata={"run": "7"})
    batch.errors = [{"code": "invalid_url", "line": 3, "message": "m", "param": "url"}]
    batch.move_to(BatchStatus.FAILED)
    session.commit()
    parsed = OpenAIBatch.model_validate(batch_object(batch))
    assert parsed.status == "failed" and parsed.failed_at is not None
    assert parsed.errors is not None and parsed.errors.data is not None
    assert parsed.errors.data[0].line == 3
    assert parsed.request_counts is not None and parsed.request_counts.total == 0
    assert parsed.metadata == {"run": "7"}


def test_completion_windows_parse() -> None:
    assert completion_window_seconds("24h") == 86_400
    assert completion_window_seconds("5s") == 5
    for bad in ("24", "h", "-1h", "1w", "1.5h"):
        with pytest.raises(ValueError):
            completion_window_seconds(bad)


def test_job_counts_start_empty(session: Session, tenant: Tenant) -> None:
    batch = new_batch(session, tenant)
    session.commit()
    assert count_batch_jobs(session, batch_id=batch.id).num_unfinished == 0
