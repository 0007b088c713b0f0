"""OpenAI Batch API end to end: the official `openai` client against the running service.

Real PostgreSQL, Redis and broker; the API, the scheduler (batch loop) and an inference
worker each run as their own process (tests.utils.batch_service) on a tiny random-weight
model, so what is checked is the service's plumbing: files in and out, validation, fan-out,
counts, cancellation, expiry and the output line format.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
import sqlalchemy as sa
from kafka import TopicPartition
from openai.types import Batch

from core.kafka import make_consumer
from core.settings import Settings
from scheduler.file_expiry import FileReaper
from storage.files import File, FileStore
from storage.models import JobStatus, utcnow
from tests.unit.engine.tiny_models import save_tiny_llama
from tests.utils.batch_service import (
    CHAT,
    TERMINAL,
    BatchService,
    batch_service,
    chat_line,
    jsonl,
    parse_jsonl,
)

logger = logging.getLogger(__name__)
# Stored for delivery only: no callbacks worker runs in these tests.
HOOK = "http://127.0.0.1:9/hook"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama directory: the engine's real code, fast on a CPU."""
    model_dir = tmp_path_factory.mktemp("tiny-llama-batches")
    save_tiny_llama(model_dir)
    return model_dir


@pytest.fixture
def service(settings: Callable[..., Settings], tmp_path: Path,
            tiny_model: Path) -> Iterator[Callable[..., BatchService]]:
    """Factory: `service(**setting_overrides)` starts the roles; they stop after the test."""
    with ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(
            batch_service(settings, tmp_path, tiny_model, **overrides))


def test_openai_client_runs_a_batch_end_to_end(service: Callable[..., BatchService]) -> None:
    svc = service()
    model = svc.settings.model
    lines = [chat_line(f"req-{i}", model, content=f"Question {i}?") for i in range(11)]
    lines.append(chat_line("req-11", model, content="Question 11?", n=2))  # two choices
    # Parses, but the worker refuses it: a per-request failure, the batch still completes.
    lines.insert(5, chat_line("req-bad", model, n=129))
    client = svc.openai()

    uploaded = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    # The batch's webhook URL rides in metadata (the official client has no field for it).
    metadata = {"suite": "e2e", "callback_url": HOOK}
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                  completion_window="24h", metadata=metadata,
                                  output_expires_after={"anchor": "created_at",
                                                        "seconds": 86_400})
    assert batch.status == "validating" and batch.metadata == metadata
    done = svc.wait_batch(client, batch.id, lambda b: b.status in TERMINAL)

    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (13, 12, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.model == model
    assert done.usage is not None and done.usage.input_tokens > 0
    assert 0 < done.usage.output_tokens <= 2 * 13
    assert done.output_file_id and done.error_file_id

    output = parse_jsonl(client.files.content(done.output_file_id).content)
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(12)]
    for line in output:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("job_")
        body = response["body"]
        assert body["object"] == "chat.completion"
        num_choices = 2 if line["custom_id"] == "req-11" else 1
        assert [c["index"] for c in body["choices"]] == list(range(num_choices))
        assert body["usage"]["completion_tokens"] <= 2 * num_choices
        assert body["choices"][0]["message"]["role"] == "assistant"
    [error] = parse_jsonl(client.files.content(done.error_file_id).content)
    assert error["custom_id"] == "req-bad"
    assert error["response"]["status_code"] == 400
    assert "n may be at most 128" in error["response"]["body"]["error"]["message"]

    [(event, url, payload)] = svc.webhook_events(batch.id)
    assert (event, url) == ("batch.completed", HOOK)
    assert payload["data"] == done.model_dump(mode="json", exclude_unset=True)
    # The batch's own deliveries can be read (a delivery's id is what a retry takes).
    deliveries: Any = client.get(f"/batches/{batch.id}/deliveries", cast_to=object)
    [delivery] = deliveries["data"]
    assert (delivery["event_type"], delivery["batch_id"]) == ("batch.completed", batch.id)
    assert delivery["id"].startswith("dlv_")
    with pytest.raises(openai.NotFoundError):
        client.get("/batches/batch_nope/deliveries", cast_to=object)

    # No worker from here: the same requests would come from the result cache, and the
    # second batch could complete before the cancel below reaches it.
    assert svc.worker is not None and svc.worker.stop() == 0
    second = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                   completion_window="24h", extra_body={"callback_url": HOOK})
    # Auto-pagination with one batch per page walks `after` / `has_more`.
    listed = [b.id for b in client.batches.list(limit=1)]
    assert listed == [second.id, batch.id]
    cancelled = client.batches.cancel(second.id)
    assert cancelled.status in ("cancelling", "cancelled")
    svc.wait_batch(client, second.id, lambda b: b.status == "cancelled")
    assert [e[0] for e in svc.webhook_events(second.id)] == ["batch.cancelled"]

    for file_id in (done.output_file_id, done.error_file_id):
        result_file = client.files.retrieve(file_id)
        assert result_file.expires_at == result_file.created_at + 86_400
    purposes = {f.id: f.purpose for f in client.files.list()}
    assert purposes[done.output_file_id] == purposes[done.error_file_id] == "batch_output"
    assert client.files.delete(uploaded.id).deleted
    assert client.files.delete(done.output_file_id).deleted


def test_invalid_files_fail_validation_by_line_and_enqueue_nothing(
    service: Callable[..., BatchService],
) -> None:
    svc = service(batch_max_requests=20)
    model = svc.settings.model
    streaming = chat_line("d", model, stream=True)
    lines: list[dict[str, object] | str] = [
        chat_line("a", model),                        # 1: fine
        '{"custom_id": "b", "method": "POST",',       # 2: malformed JSON
        {**chat_line("c", model), "custom_id": None},  # 3: missing custom_id
        chat_line("a", model),                        # 4: duplicate custom_id
        {**chat_line("e", model), "url": "/v1/completions"},  # 5: other endpoint
        streaming,                                    # 6: stream: true
        chat_line("f", "another-model"),              # 7: a second model
        {**chat_line("g", model), "method": "GET"},   # 8: not POST
    ]
    client = svc.openai()
    file = client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    unknown = client.files.create(file=("unknown.jsonl", jsonl(
        [chat_line("x", "gpt-4o-mini")])), purpose="batch")
    too_many = client.files.create(file=("many.jsonl", jsonl(
        [chat_line(f"m{i}", model) for i in range(21)])), purpose="batch")

    failures = {}
    for name, file_id in (("bad", file.id), ("unknown", unknown.id), ("many", too_many.id)):
        created = client.batches.create(input_file_id=file_id, endpoint=CHAT,
                                        completion_window="24h")
        failures[name] = svc.wait_batch(client, created.id, lambda b: b.status in TERMINAL)

    def errors_of(name: str) -> list[tuple[str | None, int | None]]:
        batch = failures[name]
        assert batch.status == "failed" and batch.failed_at, batch
        assert batch.errors is not None and batch.errors.data is not None
        return [(e.code, e.line) for e in batch.errors.data]

    assert errors_of("bad") == [
        ("invalid_json_line", 2), ("missing_custom_id", 3), ("duplicate_custom_id", 4),
        ("invalid_url", 5), ("invalid_stream", 6), ("mismatched_model", 7),
        ("invalid_method", 8)]
    assert errors_of("unknown") == [("model_not_found", 1)]
    assert errors_of("many") == [("too_many_requests", 21)]
    for batch in failures.values():
        assert svc.job_statuses(batch.id) == {}
        assert batch.output_file_id is None and batch.error_file_id is None
    # Nothing reached the broker either.
    consumer = make_consumer(svc.settings, group_id=f"{svc.settings.topic_prefix}.check")
    try:
        partitions = [TopicPartition(topic, p) for topic in svc.settings.job_topics.values()
                      for p in range(svc.settings.topic_partitions)]
        assert sum(consumer.end_offsets(partitions).values()) == 0
    finally:
        consumer.close()


def after_first_pass(svc: BatchService) -> None:
    """Until the scheduler's batch loop has made its first pass (its start is logged)."""
    deadline = time.monotonic() + 60
    while "batches every" not in svc.scheduler.log_tail() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the loop's first pass is behind it


def test_created_and_cancelled_batches_are_taken_up_at_once_not_at_the_next_pass(
    service: Callable[..., BatchService],
) -> None:
    # Ten minutes between regular passes: only the API's announcements can explain a batch
    # taken up within the waits below, however slow a loaded machine makes the first
    # fan-out (it loads the model's tokenizer).
    svc = service(start_worker=False, batch_poll_interval_s=600.0)
    after_first_pass(svc)
    client = svc.openai()
    model = svc.settings.model
    file = client.files.create(file=("wake.jsonl", jsonl(
        [chat_line(f"w{i}", model) for i in range(3)])), purpose="batch")

    started = time.monotonic()
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT,
                                  completion_window="24h")
    # Validated and fanned out in the pass the announcement brought.
    svc.wait_jobs(batch.id, lambda s: s.get(JobStatus.QUEUED) == 3, timeout=90)
    assert client.batches.retrieve(batch.id).status == "in_progress"
    client.batches.cancel(batch.id)
    done = svc.wait_batch(client, batch.id, lambda b: b.status == "cancelled", timeout=90)
    assert time.monotonic() - started < 180
    assert done.request_counts is not None and done.request_counts.failed == 3


def test_a_batch_is_completed_once_its_worker_ran_its_last_line_not_at_the_next_pass(
    service: Callable[..., BatchService],
) -> None:
    # Ten minutes between regular passes: the API's announcement brings the fan-out, and
    # only the worker's (it holds none of the batch's jobs any more) the final count.
    svc = service(batch_poll_interval_s=600.0)
    after_first_pass(svc)
    client = svc.openai()
    model = svc.settings.model
    file = client.files.create(file=("drain.jsonl", jsonl(
        [chat_line(f"d{i}", model, content=f"Line {i}?") for i in range(5)])),
        purpose="batch")
    started = time.monotonic()
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT,
                                  completion_window="24h")
    done = svc.wait_batch(client, batch.id, lambda b: b.status in TERMINAL, timeout=120)
    assert done.status == "completed", svc.logs()
    assert time.monotonic() - started < 300
    assert done.request_counts is not None and done.request_counts.completed == 5


def test_cancel_mid_run_stops_the_rest_and_keeps_partial_output(
    service: Callable[..., BatchService],
) -> None:
    # Few sequences at a time and long answers: the batch takes a while. Distinct prompts:
    # identical ones would be answered from the result cache, all 300 in about a second.
    svc = service(engine_max_num_seqs=4, worker_max_inflight=8)
    model = svc.settings.model
    num_lines = 300
    lines = [chat_line(f"c{i}", model, content=f"Question {i}?", max_tokens=48,
                       ignore_eos=True) for i in range(num_lines)]
    client = svc.openai()
    file = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    svc.wait_jobs(batch.id, lambda s: s.get(JobStatus.SUCCEEDED, 0) >= 4)

    # The worker is frozen (jobs still running in it) until the cancel is in, so the batch
    # cannot finish first however fast the engine or slow this test; it then runs on and
    # finds its jobs cancelled.
    assert svc.worker is not None
    os.kill(svc.worker.pid, signal.SIGSTOP)
    try:
        assert svc.job_statuses(batch.id).get(JobStatus.SUCCEEDED, 0) < num_lines
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    finally:
        os.kill(svc.worker.pid, signal.SIGCONT)
    done = svc.wait_batch(client, batch.id, lambda b: b.status in TERMINAL, timeout=120)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    counts = done.request_counts
    assert counts is not None and counts.total == num_lines
    assert 4 <= counts.completed < num_lines
    assert counts.completed + counts.failed == num_lines

    output = parse_jsonl(client.files.content(done.output_file_id or "").content)
    errors = parse_jsonl(client.files.content(done.error_file_id or "").content)
    assert len(output) == counts.completed and len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    custom_ids = [line["custom_id"] for line in output + errors]
    assert sorted(custom_ids) == sorted(f"c{i}" for i in range(num_lines))

    statuses = svc.job_statuses(batch.id)
    assert statuses.get(JobStatus.QUEUED, 0) == statuses.get(JobStatus.RUNNING, 0) == 0
    assert statuses[JobStatus.SUCCEEDED] == counts.completed
    # Nothing ran on after the cancel: a marker batch submitted now completes, so the worker
    # consumed past the cancelled batch's messages (in order, per partition: eight keys
    # spread over both), and the cancelled batch's rows are as they were.
    markers = [chat_line(f"m{i}", model, content=f"Marker {i}.", max_tokens=1) for i in range(8)]
    marker_file = client.files.create(file=("marker.jsonl", jsonl(markers)), purpose="batch")
    marker = client.batches.create(input_file_id=marker_file.id, endpoint=CHAT,
                                   completion_window="24h")
    marked = svc.wait_batch(client, marker.id, lambda b: b.status in TERMINAL, timeout=120)
    assert marked.status == "completed", marked
    assert svc.job_statuses(batch.id) == statuses


def test_expiry_keeps_what_finished_and_marks_the_rest_batch_expired(
    service: Callable[..., BatchService],
) -> None:
    svc = service(engine_max_num_seqs=4, worker_max_inflight=8)
    model = svc.settings.model
    num_lines = 1000
    # Distinct prompts (none answered from the result cache) and long answers: the worker
    # cannot get through the rest in the moment it takes to stop it.
    lines = [chat_line(f"e{i}", model, content=f"Question {i}?", max_tokens=192,
                       ignore_eos=True) for i in range(num_lines)]
    client = svc.openai()
    file = client.files.create(file=("slow.jsonl", jsonl(lines)), purpose="batch")
    # Shorter than OpenAI's one window; the test settings allow it.
    window: Any = "8s"
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window=window)
    assert batch.expires_at is not None and batch.expires_at - batch.created_at == 8
    # The test keeps the window's clock: held open while some requests finish, however
    # slow the machine; then the worker stops, so the rest certainly do not, however fast
    # the engine; only then does the window end.
    svc.set_expires_at(batch.id, utcnow() + timedelta(hours=1))
    svc.wait_jobs(batch.id, lambda s: s.get(JobStatus.SUCCEEDED, 0) >= 8)
    assert svc.worker is not None and svc.worker.stop() == 0
    before = svc.job_statuses(batch.id)
    num_finished = before.get(JobStatus.SUCCEEDED, 0)
    assert before.get(JobStatus.RUNNING, 0) == 0 and 8 <= num_finished < num_lines, before
    svc.wait_jobs(batch.id, lambda s: sum(s.values()) == num_lines)  # all fanned out
    svc.set_expires_at(batch.id, utcnow())

    done = svc.wait_batch(client, batch.id, lambda b: b.status in TERMINAL, timeout=120)
    assert done.status == "expired" and done.expired_at, done
    counts = done.request_counts
    assert counts is not None and counts.total == num_lines
    assert (counts.completed, counts.failed) == (num_finished, num_lines - num_finished)
    output = parse_jsonl(client.files.content(done.output_file_id or "").content)
    errors = parse_jsonl(client.files.content(done.error_file_id or "").content)
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert all(e["response"] is None for e in errors)
    custom_ids = [line["custom_id"] for line in output + errors]
    assert sorted(custom_ids) == sorted(f"e{i}" for i in range(num_lines))
    assert svc.job_statuses(batch.id) == {JobStatus.SUCCEEDED: num_finished,
                                          JobStatus.CANCELLED: num_lines - num_finished}


def test_expiring_files_vanish_and_one_scheduler_pass_deletes_them(
    service: Callable[..., BatchService],
) -> None:
    # No worker: the cancelled batch's requests all land in its error file.
    svc = service(start_worker=False)
    client = svc.openai()
    lines = [chat_line(f"x{i}", svc.settings.model) for i in range(3)]
    file = client.files.create(file=("x.jsonl", jsonl(lines)), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert file.expires_at == file.created_at + 3600
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h",
                                  output_expires_after={"anchor": "created_at", "seconds": 7200})
    svc.wait_batch(client, batch.id, lambda b: b.status == "in_progress")
    client.batches.cancel(batch.id)
    done = svc.wait_batch(client, batch.id, lambda b: b.status == "cancelled")
    assert done.output_file_id is None and done.error_file_id is not None
    error_file = client.files.retrieve(done.error_file_id)
    assert error_file.expires_at == error_file.created_at + 7200

    store = FileStore.from_settings(svc.settings)
    with svc.sessions() as session:
        session.execute(sa.update(File).where(File.id.in_([file.id, error_file.id]))
                        .values(expires_at=utcnow() - timedelta(seconds=1)))
        session.commit()
    for file_id in (file.id, error_file.id):
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            client.files.content(file_id)
        assert store.path(file_id).exists()
    assert {f.id for f in client.files.list()}.isdisjoint({file.id, error_file.id})

    FileReaper(svc.sessions, store, interval_s=60).step()
    with svc.sessions() as session:
        assert session.scalars(sa.select(File.id).where(
            File.id.in_([file.id, error_file.id]))).all() == []
    assert not store.path(file.id).exists() and not store.path(error_file.id).exists()
    # The batch keeps naming its files, as after a delete.
    assert client.batches.retrieve(batch.id).input_file_id == file.id


@pytest.mark.slow
# Ten thousand lines through the whole service: its own deadline (1,500 s) ends first.
@pytest.mark.timeout(1800)
def test_ten_thousand_lines_complete_once_each_with_flat_api_memory(
    service: Callable[..., BatchService],
) -> None:
    svc = service(engine_max_num_seqs=128, worker_max_inflight=256)
    model = svc.settings.model
    num_lines = 10_000
    lines = [chat_line(f"row-{i:05d}", model, content=f"Item {i}.", max_tokens=1)
             for i in range(num_lines)]
    client = svc.openai()
    # Warm the API's code paths first, so the baseline is the steady state.
    warm = client.files.create(file=("warm.jsonl", jsonl(lines[:10])), purpose="batch")
    client.files.content(warm.id).read()
    baseline = svc.api_rss_settled()
    started = time.monotonic()

    file = client.files.create(file=("ten-thousand.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    samples = [svc.api.rss_bytes]

    def sample_and_check(b: Batch) -> bool:
        samples.append(svc.api.rss_bytes)
        return b.status in TERMINAL

    done = svc.wait_batch(client, batch.id, sample_and_check, timeout=1500)
    elapsed = time.monotonic() - started
    output = parse_jsonl(client.files.content(done.output_file_id or "").content)
    samples.append(svc.api.rss_bytes)

    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (num_lines, num_lines, 0)
    assert done.error_file_id is None
    custom_ids = [line["custom_id"] for line in output]
    assert len(custom_ids) == len(set(custom_ids)) == num_lines
    assert set(custom_ids) == {f"row-{i:05d}" for i in range(num_lines)}
    assert svc.job_statuses(batch.id) == {JobStatus.SUCCEEDED: num_lines}

    mib = 1024 * 1024
    peak_growth = max(samples) - baseline
    report = (f"10k batch: {elapsed:.1f}s, API RSS baseline {baseline / mib:.1f} MiB, "
              f"peak {max(samples) / mib:.1f} MiB (+{peak_growth / mib:.1f}), end "
              f"{samples[-1] / mib:.1f} MiB, {len(samples)} samples")
    logger.info(report)
    assert peak_growth < 40 * mib, report
