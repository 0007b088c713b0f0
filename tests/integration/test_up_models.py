"""`batchinfer up` with two models: a chat model directory and the packaged embedding model.

Each model is served under its --served-model-name, gets its own worker process consuming
only its own topics, and answers its own kind of request; results carry the model's
weights revision.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from safetensors.torch import save_file

from core.settings import Settings
from scheduler.embedded_services import free_port
from tests.unit.engine.tiny_models import save_tiny_llama, save_tokenizer, tiny_llama_config
from tests.utils.budget import within_budget
from tests.utils.up_process import UpProcess, start_up

# Each test runs `batchinfer up` or a real model, several minutes on a loaded machine; its
# own waits end first, with their diagnostics.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def up_two_models(tmp_path: Path) -> Iterator[UpProcess]:
    """`up` serving a random tiny Llama as `tiny` and all-MiniLM-L6-v2 as `emb`."""
    save_tiny_llama(tmp_path / "tiny-llama")
    run = start_up(tmp_path / "data", free_port(), num_workers=1, log_path=tmp_path / "up.log",
                   extra_env={"BATCHINFER_MODELS_DIR": str(tmp_path / "models")},
                   args=["--model", str(tmp_path / "tiny-llama"), "--served-model-name", "tiny",
                         "--model", "all-minilm-l6-v2", "--served-model-name", "emb"])
    try:
        yield run
    finally:
        if run.process.poll() is None:
            run.kill_tree()


def _wait(client: httpx.Client, job_id: str, timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + within_budget(timeout)
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}", params={"wait": 10}).json()
        if job["status"] not in ("queued", "running"):
            return job
    raise AssertionError(f"job {job_id} did not finish in {timeout}s")


def test_up_serves_two_models_each_on_its_own_workers(up_two_models: UpProcess) -> None:
    """Banner, model list, one worker per model, each kind answered with its revision."""
    run = up_two_models
    banner = {name: line for line in run.lines
              if (m := re.match(r"model (\S+) \((\w+), revision (\w+)\)", line))
              for name in [m.group(1)]}
    assert set(banner) == {"tiny", "emb"}, run.lines
    # Each model says when a worker takes its jobs; the API then counts that worker.
    for name in ("tiny", "emb"):
        run.wait_for_line(f"model {name} ready: 1 worker(s) taking jobs", 600)
    assert len(run.running("workers.inference")) == 2
    with run.client() as client:
        models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert {name: m["kind"] for name, m in models.items()} == {"tiny": "chat",
                                                                    "emb": "embedding"}
        assert {name: (m["state"], m["live_workers"]) for name, m in models.items()} == {
            "tiny": ("ready", 1), "emb": ("ready", 1)}
        assert client.get("/readyz").json()["models_not_ready"] == []
        chat = client.post("/v1/jobs", json={
            "model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0,
            "ignore_eos": True})
        assert chat.status_code == 202, chat.text
        embedding = client.post("/v1/embeddings", json={"model": "emb", "input": ["hello"]},
                                timeout=600)
        assert embedding.status_code == 200, embedding.text
        assert len(embedding.json()["data"][0]["embedding"]) == 384
        job = _wait(client, chat.json()["id"])
        assert job["status"] == "succeeded", job
        revision = client.get("/v1/models/tiny").json()["revision"]
        assert revision and job["result"]["system_fingerprint"] == f"fp_{revision}"
        wrong = client.post("/v1/embeddings", json={"model": "tiny", "input": "x"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model"
    # Each worker consumes only its model's topics, in its model's group.
    log = run.log_tail(200_000)
    for name in ("tiny", "emb"):
        topics = Settings(topic_prefix="batchinfer", served_model_name=name).job_topics
        assert any(all(t in line for t in topics.values()) for line in log.splitlines()), name
    assert run.stop() == 0, run.log_tail()
    # Workers leave without the teardown in which Triton's extension reports its objects.
    assert "nanobind" not in run.log_tail(1_000_000)


def test_up_marks_a_model_that_never_loads_failed_and_refuses_its_new_jobs(
        tmp_path: Path) -> None:
    """A Llama directory whose weights file holds none of the model's tensors passes the
    start-up check (config, weights file and tokenizer are there) but every worker's load
    fails: after a few tries `up` says the model failed, the API lists it failed with the
    load's error and refuses new jobs with 503 model_unavailable; a job accepted before
    stays queued (nothing lost), and `up` still stops cleanly."""
    model_dir = tmp_path / "wrong-weights"
    tiny_llama_config().save_pretrained(model_dir)
    save_tokenizer(model_dir)
    save_file({"unrelated": torch.zeros(1)}, str(model_dir / "model.safetensors"))
    run = start_up(tmp_path / "data", free_port(), num_workers=1, log_path=tmp_path / "up.log",
                   extra_env={"BATCHINFER_MODELS_DIR": str(tmp_path / "models")},
                   args=["--model", str(model_dir), "--served-model-name", "broken"])
    try:
        with run.client() as client:
            early = client.post("/v1/jobs", json={"model": "broken", "prompt": "hi"})
            assert early.status_code == 202, early.text
            line = run.wait_for_line("model broken failed to load", 300)
            listed = client.get("/v1/models/broken").json()
            assert (listed["state"], listed["live_workers"]) == ("failed", 0), listed
            assert listed["error"] and listed["error"] in line
            deadline = time.monotonic() + 10  # the API re-reads states every second
            while (refused := client.post("/v1/jobs", json={"model": "broken", "prompt": "hi"})
                   ).status_code == 202 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "model_unavailable"
            assert listed["error"] in refused.json()["error"]["message"]
            job = client.get(f"/v1/jobs/{early.json()['id']}").json()
            assert job["status"] == "queued", job
            assert client.get("/readyz").json()["models"]["broken"]["state"] == "failed"
        assert run.stop() == 0, run.log_tail()
    finally:
        if run.process.poll() is None:
            run.kill_tree()


def test_a_second_stop_hands_unfinished_jobs_back_at_once(tmp_path: Path) -> None:
    """With a drain timeout far longer than the test's, a first SIGTERM starts the drain and
    a second one makes every worker hand its unfinished jobs back: `up` exits, and every job
    is either done or `queued` again (none left `running`, none lost)."""
    from sqlalchemy import func, select

    from storage.db import create_db_engine, session_factory
    from storage.models import Job

    save_tiny_llama(tmp_path / "tiny-llama")
    run = start_up(tmp_path / "data", free_port(), num_workers=1, log_path=tmp_path / "up.log",
                   extra_env={"BATCHINFER_MODELS_DIR": str(tmp_path / "models"),
                              "BATCHINFER_WORKER_DRAIN_TIMEOUT_S": "3600"},
                   args=["--model", str(tmp_path / "tiny-llama"), "--served-model-name", "tiny"])
    try:
        run.wait_for_line("model tiny ready", 600)
        with run.client() as client:
            for i in range(128):
                response = client.post("/v1/jobs", json={
                    "model": "tiny", "prompt": f"job {i}", "max_tokens": 1000,
                    "temperature": 0, "ignore_eos": True})
                assert response.status_code == 202, response.text
            deadline = time.monotonic() + 300
            while client.get("/v1/jobs", params={"status": "running", "limit": 1}
                             ).json()["total"] == 0:
                assert time.monotonic() < deadline, "no job started"
                time.sleep(0.2)
        run.process.send_signal(signal.SIGTERM)
        run.wait_for_line("stopping:", 60)
        run.process.send_signal(signal.SIGTERM)
        run.wait_for_line("stopping now", 60)
        assert run.process.wait(300) == 0, run.log_tail()
    finally:
        if run.process.poll() is None:
            run.kill_tree()
    engine = create_db_engine(f"sqlite:///{tmp_path / 'data' / 'batchinfer.db'}")
    with session_factory(engine)() as session:
        counts = dict(session.execute(
            select(Job.status, func.count()).group_by(Job.status)).all())
    engine.dispose()
    assert sum(counts.values()) == 128
    assert {status.value for status in counts} <= {"queued", "succeeded"}, counts
    assert "released" in run.log_tail(200_000)


def test_a_model_only_the_full_check_refuses_stops_what_started_and_exits_2(
        tmp_path: Path) -> None:
    """A Llama config (its family is served, so the early read passes) with a quantization
    the engine does not run: the full check, forked from the warm server once the broker,
    Redis and the schema are up, refuses it; `up` exits 2 with the engine's reason and
    leaves no broker, Redis or warm server running."""
    import subprocess
    import sys

    from tests.utils.up_process import ROOT

    model_dir = tmp_path / "bnb-llama"
    tiny_llama_config(quantization_config={"quant_method": "bitsandbytes",
                                           "load_in_4bit": True}).save_pretrained(model_dir)
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    env["BATCHINFER_MODELS_DIR"] = str(tmp_path / "models")
    up = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--port", str(free_port()), "--data-dir",
         str(data_dir), "--model", str(model_dir), "--served-model-name", "bnb"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "up.log").open("wb"), env=env, cwd=ROOT)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + within_budget(300)
    try:
        while up.poll() is None:
            assert time.monotonic() < deadline, "up neither refused the model nor stopped"
            try:
                seen.update((c.pid, c) for c in psutil.Process(up.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.1)
    finally:
        if up.poll() is None:
            up.kill()
    log = (tmp_path / "up.log").read_text(errors="replace")
    assert up.returncode == 2, log[-3000:]
    assert f"batchinfer up: {model_dir} cannot be served: model quantization" in log, log[-3000:]
    assert "started tansu" in log and "started redis" in log, log[-3000:]  # the early read
    # The warm server ends when `up` has gone, after its interpreter's teardown (seconds
    # with torch imported, more on a loaded machine); nothing may keep running.
    _, alive = psutil.wait_procs(list(seen.values()), timeout=within_budget(60))
    assert alive == [], f"still running after up exited: {[p.cmdline()[:4] for p in alive]}"
