"""The bulk CLI and big files against the running service (API, scheduler, worker).

`batchinfer batch run` is run as users run it, in a child process: interrupted with
Ctrl-C (SIGINT) mid-batch, then reattached by batch id to write the results. A 150 MB
upload and its download go through the API while its memory is watched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import pytest

from cli.batch_client import BatchClient
from core.settings import Settings
from tests.unit.engine.tiny_models import save_tiny_llama
from tests.utils.batch_service import BatchService, batch_service, chat_line, jsonl, parse_jsonl
from tests.utils.budget import within_budget

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
T = TypeVar("T")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama directory: the engine's real code, fast on a CPU."""
    model_dir = tmp_path_factory.mktemp("tiny-llama-batch-cli")
    save_tiny_llama(model_dir)
    return model_dir


@pytest.fixture
def service(settings: Callable[..., Settings], tmp_path: Path,
            tiny_model: Path) -> Iterator[Callable[..., BatchService]]:
    """Factory: `service(**setting_overrides)` starts the roles; they stop after the test."""
    with ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(
            batch_service(settings, tmp_path, tiny_model, **overrides))


def cli(svc: BatchService, *args: str) -> list[str]:
    """argv of `batchinfer batch ...` against this service."""
    return [sys.executable, "-m", "cli", "batch", *args, "--url", svc.url,
            "--api-key", svc.api_key]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_run_interrupted_then_reattached_writes_every_result(
    service: Callable[..., BatchService], tmp_path: Path,
) -> None:
    # No worker until the first CLI has been interrupted and the second has reattached: the
    # batch cannot finish before either, however fast the engine or slow the machine.
    svc = service(start_worker=False, engine_max_num_seqs=4, worker_max_inflight=8)
    # No more than the consumer's max_poll_records (100): a worker that starts on a bigger
    # backlog in one partition can stall on it (kafka-python 3.0.12 parks the records left
    # over when the worker pauses that partition, and never restores or refetches them).
    num_lines = 100
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(jsonl([chat_line(f"q{i}", svc.settings.model, max_tokens=32,
                                          ignore_eos=True) for i in range(num_lines)]))
    output = tmp_path / "results.jsonl"
    client = svc.openai()

    # Ctrl-C must reach it as KeyboardInterrupt even when the tests themselves run in the
    # background, where the shell starts everything with SIGINT ignored.
    first = subprocess.Popen(cli(svc, "run", str(requests), "-o", str(output),
                                 "--poll-interval", "0.3"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=ROOT, preexec_fn=_default_sigint)
    assert first.stdout is not None
    batch_id = None
    for line in first.stdout:
        if match := re.search(r"--batch-id (batch_\w+)", line):
            batch_id = match.group(1)
            break
    assert batch_id, "the CLI never said which batch it created"
    # Interrupt once the batch runs (validated, its requests queued) while the CLI follows.
    svc.wait_batch(client, batch_id, lambda b: b.status == "in_progress", timeout=120)
    first.send_signal(signal.SIGINT)
    rest, _ = first.communicate(timeout=30)
    assert first.returncode == 130, rest
    assert "keeps running" in rest and not output.exists()
    assert client.batches.retrieve(batch_id).status == "in_progress"

    reattached = subprocess.Popen(cli(svc, "run", "-o", str(output), "--batch-id", batch_id,
                                      "--poll-interval", "0.3"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=ROOT)
    assert reattached.stderr is not None
    attached_line = reattached.stderr.readline()
    # Attached to the batch while it still runs; only now can its requests finish.
    assert f"reattached to {batch_id} (in_progress)" in attached_line, attached_line
    try:
        svc.start_worker()
        try:
            _, stderr = reattached.communicate(timeout=within_budget(600))
        except subprocess.TimeoutExpired:
            pytest.fail(f"`batch run` never finished: {attached_line}{svc.logs()}")
    finally:
        reattached.kill()
    assert reattached.returncode == 0, attached_line + stderr + svc.logs()
    assert f"{num_lines} ok · 0 failed / {num_lines}" in stderr
    results = parse_jsonl(output.read_bytes())
    assert sorted(r["custom_id"] for r in results) == sorted(f"q{i}" for i in range(num_lines))
    assert not (tmp_path / "results.errors.jsonl").exists()

    shown = subprocess.run(cli(svc, "get", batch_id), capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
    assert json.loads(shown.stdout)["status"] == "completed"
    listed = subprocess.run(cli(svc, "list"), capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    [row] = [line.split("\t") for line in listed.stdout.splitlines()[1:]]
    assert row[:5] == [batch_id, "completed", str(num_lines), "0", str(num_lines)]
    refused = subprocess.run(cli(svc, "cancel", batch_id), capture_output=True, text=True,
                             timeout=60, cwd=ROOT)
    assert refused.returncode == 1 and "can no longer be cancelled" in refused.stderr


def test_a_150_mib_file_streams_through_the_api_in_flat_memory(
    service: Callable[..., BatchService], tmp_path: Path,
) -> None:
    svc = service()
    big = tmp_path / "big.jsonl"
    line = json.dumps(chat_line("x" * 20, svc.settings.model, content="y" * 900)) + "\n"
    digest = hashlib.sha256()
    with big.open("w") as handle:
        while handle.tell() < 150 * MIB:
            handle.write(line)
            digest.update(line.encode())
    with BatchClient(svc.url, svc.api_key) as client:
        warm = tmp_path / "warm.jsonl"
        warm.write_text(line)
        client.download(client.upload(warm)["id"], tmp_path / "warm.out")
        baseline = svc.api_rss_settled()
        samples: list[int] = []
        started = time.monotonic()
        uploaded: dict[str, Any] = _while_sampling(svc, samples, lambda: client.upload(big))
        upload_s = time.monotonic() - started
        copy = tmp_path / "copy.jsonl"
        started = time.monotonic()
        _while_sampling(svc, samples, lambda: client.download(uploaded["id"], copy))
        download_s = time.monotonic() - started

    assert uploaded["bytes"] == big.stat().st_size
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == digest.hexdigest()
    growth = max(samples) - baseline
    report = (f"150 MiB file: upload {upload_s:.1f}s, download {download_s:.1f}s, API RSS "
              f"baseline {baseline / MIB:.1f} MiB, peak {max(samples) / MIB:.1f} MiB "
              f"(+{growth / MIB:.1f}), {len(samples)} samples")
    logger.info(report)
    assert growth < 40 * MIB, report


def _while_sampling(svc: BatchService, samples: list[int], call: Callable[[], T]) -> T:
    """Run `call` on a thread, sampling the API's RSS every 50 ms until it returns."""
    outcome: list[T] = []
    thread = threading.Thread(target=lambda: outcome.append(call()))
    thread.start()
    while thread.is_alive():
        samples.append(svc.api.rss_bytes)
        thread.join(0.05)
    samples.append(svc.api.rss_bytes)
    assert outcome, "the call raised; see the thread's traceback above"
    return outcome[0]
