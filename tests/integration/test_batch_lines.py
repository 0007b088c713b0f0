"""A running batch's finished lines and live counts, through the official client and httpx.

The API, the scheduler and a worker on the tiny model run as their own processes (see
tests.utils.batch_service). The worker is frozen mid-batch (SIGSTOP), so what "finished
so far" means cannot move while it is checked.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from storage.models import JobStatus
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


@pytest.fixture
def svc(settings, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[BatchService]:
    model_dir = tmp_path_factory.mktemp("tiny-llama-lines")
    save_tiny_llama(model_dir)
    with batch_service(settings, tmp_path, model_dir, engine_max_num_seqs=4,
                       worker_max_inflight=8) as service:
        yield service


def test_a_running_batch_shows_its_finished_lines_in_input_order(svc: BatchService) -> None:
    model = svc.settings.model
    num_lines = 120
    lines = [chat_line(f"r{i}", model, content=f"Question {i}?", max_tokens=32,
                       ignore_eos=True) for i in range(num_lines)]
    lines.insert(3, chat_line("bad", model, n=129))  # refused: an error line
    client = svc.openai()
    file = client.files.create(file=("lines.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    svc.wait_jobs(batch.id, lambda s: s.get(JobStatus.SUCCEEDED, 0) >= 6
                  and s.get(JobStatus.FAILED, 0) == 1)
    assert svc.worker is not None
    os.kill(svc.worker.pid, signal.SIGSTOP)
    try:
        statuses = svc.job_statuses(batch.id)
        num_succeeded = statuses[JobStatus.SUCCEEDED]
        assert num_succeeded < num_lines
        # The counts follow the jobs while the batch runs (each scheduler pass).
        running = svc.wait_batch(client, batch.id, lambda b: b.request_counts is not None
                                 and b.request_counts.completed == num_succeeded)
        assert running.status == "in_progress" and running.output_file_id is None
        assert running.request_counts is not None and running.request_counts.failed == 1
        with httpx.Client(base_url=svc.url, timeout=60,
                          headers={"Authorization": f"Bearer {svc.api_key}"}) as http:
            so_far = http.get(f"/v1/batches/{batch.id}/output")
            errors_so_far = http.get(f"/v1/batches/{batch.id}/errors")
            missing = http.get("/v1/batches/batch_missing/output")
    finally:
        os.kill(svc.worker.pid, signal.SIGCONT)
    assert so_far.status_code == 200, so_far.text
    assert so_far.headers["content-type"].startswith("application/jsonl")
    assert so_far.headers["x-batch-status"] == "in_progress"
    partial = parse_jsonl(so_far.content)
    assert len(partial) == num_succeeded
    order = [int(line["custom_id"][1:]) for line in partial]
    assert order == sorted(order)
    [bad] = parse_jsonl(errors_so_far.content)
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400
    assert missing.status_code == 404

    done = svc.wait_batch(client, batch.id, lambda b: b.status in TERMINAL)
    assert done.status == "completed" and done.output_file_id
    final = parse_jsonl(client.files.content(done.output_file_id).content)
    assert [line["custom_id"] for line in final] == [f"r{i}" for i in range(num_lines)]
    # The lines read early are the final file's lines, byte for byte in content.
    by_custom_id = {line["custom_id"]: line for line in final}
    assert all(line == by_custom_id[line["custom_id"]] for line in partial)
