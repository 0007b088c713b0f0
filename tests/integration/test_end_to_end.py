"""60 jobs over HTTP → API → Kafka → worker → PostgreSQL; greedy results equal LLM.generate.

The real services: Tansu broker, Redis and PostgreSQL from the session fixtures, the API
app on a thread of this process, and one inference worker process on the real model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.kafka import ensure_topics
from core.settings import Settings
from storage.db import create_db_engine, session_factory
from storage.migrate import upgrade
from tests.utils.api import make_tenant_key
from tests.utils.budget import within_budget
from tests.utils.service import WorkerProcess, running_api

# Each test runs `batchinfer up` or a real model, several minutes on a loaded machine; its
# own waits end first, with their diagnostics.
pytestmark = pytest.mark.timeout(900)

MODEL = "smollm2-135m-instruct"
NUM_JOBS = 60
MAX_TOKENS = 8
PRIORITIES = ("high", "normal", "low")
TOPICS = ["the moon", "bread", "rivers", "chess", "owls", "volcanoes", "jazz", "glass",
          "tea", "bicycles"]


def _job_bodies() -> list[dict[str, Any]]:
    """Half chat, half text completions, priorities interleaved, every prompt distinct."""
    bodies = []
    for i in range(NUM_JOBS):
        topic = TOPICS[i % len(TOPICS)]
        body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                                "priority": PRIORITIES[i % 3]}
        if i % 2 == 0:
            body["messages"] = [{"role": "user",
                                 "content": f"Question {i}: tell me one fact about {topic}."}]
        else:
            body["prompt"] = f"Note {i}. A short sentence about {topic}:"
        bodies.append(body)
    return bodies


def _prompt_of(body: dict[str, Any]) -> Any:
    return body["messages"] if "messages" in body else body["prompt"]


def _text_of(result: dict[str, Any]) -> str:
    choice = result["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.fixture
def service(settings, tmp_path: Path, smollm2_dir: Path):
    """Migrated PostgreSQL, topics, a tenant key, the API and one worker."""
    s: Settings = settings(topic_partitions=3)
    upgrade(s.database_url)
    ensure_topics(s)
    engine = create_db_engine(s.database_url)
    tenant = make_tenant_key(session_factory(engine), "e2e")
    worker = WorkerProcess(s, tmp_path / "worker.log")
    try:
        with running_api(s) as url:
            yield s, url, tenant.headers, worker
    finally:
        code = worker.stop()
        engine.dispose()
        assert code == 0, f"worker exit code {code}; log:\n{worker.log_tail()}"


def _wait_all(client: httpx.Client, job_ids: list[str], worker: WorkerProcess,
              timeout: float) -> dict[str, dict[str, Any]]:
    """Poll the job list until every job has finished; then each job as read by id."""
    deadline = time.monotonic() + within_budget(timeout)
    while True:
        page = client.get("/v1/jobs", params={"limit": 100}).json()["data"]
        active = [j["id"] for j in page if j["status"] in ("queued", "running")]
        if len(page) == len(job_ids) and not active:
            break
        assert time.monotonic() < deadline, (
            f"{len(active)} jobs unfinished after {timeout}s; worker log:\n{worker.log_tail()}")
        assert worker.process.poll() is None, f"worker died:\n{worker.log_tail()}"
        time.sleep(0.5)
    return {job_id: client.get(f"/v1/jobs/{job_id}").json() for job_id in job_ids}


def test_sixty_mixed_priority_jobs_succeed_with_offline_greedy_results(service) -> None:
    """Every job succeeds once, and its text equals the engine's offline greedy output."""
    s, url, headers, worker = service
    bodies = _job_bodies()
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        job_ids = []
        for body in bodies:
            response = client.post("/v1/jobs", json=body)
            assert response.status_code == 202, response.text
            job_ids.append(response.json()["id"])
        jobs = _wait_all(client, job_ids, worker, timeout=600)
        listed = client.get("/v1/jobs", params={"status": "succeeded", "limit": 100}).json()

    failed = {i: j for i, j in jobs.items() if j["status"] != "succeeded"}
    assert not failed, failed
    assert sorted(j["id"] for j in listed["data"]) == sorted(job_ids)
    for job_id, body in zip(job_ids, bodies, strict=True):
        job = jobs[job_id]
        assert job["priority"] == body["priority"]
        kind = "chat.completion" if "messages" in body else "text_completion"
        assert job["result"]["object"] == kind
        assert 0 < job["usage"]["completion_tokens"] <= MAX_TOKENS

    from workers.engine import LLM, SamplingParams

    # The worker's engine options, so both sides run the same dtype on the same device.
    llm = LLM(model=MODEL, models_dir=s.models_dir, dtype=s.engine_dtype,
              device=s.engine_device)
    offline = llm.generate([_prompt_of(b) for b in bodies],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    mismatches = [(body, _text_of(jobs[job_id]["result"]), out.text)
                  for job_id, body, out in zip(job_ids, bodies, offline, strict=True)
                  if _text_of(jobs[job_id]["result"]) != out.text]
    assert not mismatches, mismatches
