"""The API against the real services: Tansu broker, Redis, PostgreSQL, served by uvicorn.

What reaches Kafka is read back from the topics; what is refused leaves no row and no
record. The OpenAI client test also runs an inference worker on the real model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from kafka import TopicPartition
from openai.types import Completion
from openai.types.chat import ChatCompletion
from sqlalchemy.orm import Session, sessionmaker

from core.kafka import ensure_topics, make_consumer
from core.messages import JobMessage, prompt_affinity_key
from core.settings import Settings
from scheduler.embedded_services import free_port, tansu_service
from storage.db import create_db_engine, session_factory
from storage.events import CancelSubscription, publish_job_done
from storage.jobs import complete_job
from storage.migrate import upgrade
from storage.models import Job, JobStatus
from tests.utils.api import TenantKey, count_jobs, make_tenant_key
from tests.utils.service import WorkerProcess, running_api

MODEL = "smollm2-135m-instruct"
CHAT: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0,
                        "messages": [{"role": "user", "content": "Say hi."}]}


@dataclass
class Service:
    """The API under test and what a test needs around it."""

    settings: Settings
    url: str
    sessions: sessionmaker[Session]
    acme: TenantKey
    globex: TenantKey

    def client(self, tenant: TenantKey | None = None) -> httpx.Client:
        """An HTTP client for the API, authenticated as `tenant` (acme by default)."""
        return httpx.Client(base_url=self.url, headers=(tenant or self.acme).headers,
                            timeout=30)

    def records(self, *, expect: int, timeout: float = 10.0) -> list[Any]:
        """Every record on the three job topics, once `expect` are there (or the timeout)."""
        consumer = make_consumer(self.settings, group_id=f"{self.settings.topic_prefix}.read")
        try:
            partitions = [TopicPartition(topic, p)
                          for topic in self.settings.job_topics.values()
                          for p in sorted(consumer.partitions_for_topic(topic) or ())]
            consumer.assign(partitions)
            consumer.seek_to_beginning(*partitions)
            found: list[Any] = []
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and len(found) < expect:
                for batch in consumer.poll(timeout_ms=200).values():
                    found.extend(batch)
            # A little longer: more than expected would be a bug too.
            for batch in consumer.poll(timeout_ms=500).values():
                found.extend(batch)
            return found
        finally:
            consumer.close()


@pytest.fixture
def service(settings: Any, tmp_path: Path) -> Iterator[Service]:
    """Migrated PostgreSQL, the topics, two tenants and the API on uvicorn."""
    s: Settings = settings(topic_partitions=3, served_models=[MODEL],
                           tenant_rate_limit_per_s=1000.0)
    upgrade(s.database_url)
    ensure_topics(s)
    engine = create_db_engine(s.database_url)
    sessions = session_factory(engine)
    try:
        acme, globex = make_tenant_key(sessions, "acme"), make_tenant_key(sessions, "globex")
        with running_api(s) as url:
            yield Service(s, url, sessions, acme, globex)
    finally:
        engine.dispose()


def test_jobs_land_on_their_priority_topic_keyed_by_prompt_prefix(service: Service) -> None:
    """Each priority has its topic; the key is the prefix-affinity hash or the cache_key."""
    system = "You are a meticulous assistant. " * 10  # > one affinity block
    bodies = [
        CHAT | {"priority": "high"},
        CHAT | {"priority": "low", "prompt": "Once upon", "messages": None},
        {**CHAT, "messages": [{"role": "system", "content": system},
                              {"role": "user", "content": "first"}]},
        {**CHAT, "messages": [{"role": "system", "content": system},
                              {"role": "user", "content": "second"}]},
        CHAT | {"cache_key": "tenant-a/system-v2"},
    ]
    with service.client() as client:
        job_ids = []
        for body in bodies:
            present = {k: v for k, v in body.items() if v is not None}
            response = client.post("/v1/jobs", json=present)
            assert response.status_code == 202, response.text
            job_ids.append(response.json()["id"])
    by_id = {JobMessage.decode(r.value).job_id: r for r in service.records(expect=5)}
    assert sorted(by_id) == sorted(job_ids)
    topics = service.settings.job_topics
    expected_topics = [topics["high"], topics["low"], topics["normal"], topics["normal"],
                       topics["normal"]]
    assert [by_id[j].topic for j in job_ids] == expected_topics
    with service.sessions() as session:
        for job_id in job_ids[:4]:
            job = session.get(Job, job_id)
            assert job is not None and job.queued_at is not None
            assert by_id[job_id].key == prompt_affinity_key(job.request, MODEL)
    assert by_id[job_ids[4]].key == b"tenant-a/system-v2"
    # Same system prompt, different questions: same key, so same partition and worker.
    assert by_id[job_ids[2]].partition == by_id[job_ids[3]].partition
    message = JobMessage.decode(by_id[job_ids[0]].value)
    assert message.kind == "chat.completion" and message.priority == "high"
    assert message.body == {"model": MODEL, "messages": CHAT["messages"], "max_tokens": 4,
                            "temperature": 0.0}


def test_idempotent_replay_publishes_once_and_conflict_is_409(service: Service) -> None:
    """A replayed key returns the same job and produces nothing more; a changed body is 409."""
    with service.client() as client:
        headers = {"Idempotency-Key": "nightly-run-17"}
        first = client.post("/v1/jobs", json=CHAT, headers=headers)
        again = client.post("/v1/jobs", json=CHAT, headers=headers)
        other = client.post("/v1/jobs", json=CHAT | {"max_tokens": 5}, headers=headers)
    assert (first.status_code, again.status_code, other.status_code) == (202, 200, 409)
    assert again.json()["id"] == first.json()["id"]
    assert other.json()["error"]["param"] == "Idempotency-Key"
    assert len(service.records(expect=1)) == 1
    assert count_jobs(service.sessions) == 1


def test_refused_requests_write_nothing_anywhere(service: Service) -> None:
    """Bad payloads, bad keys, oversize bodies: 4xx naming the problem, no row, no record."""
    with service.client() as client:
        cases = [
            (client.post("/v1/jobs", json=CHAT | {"temperature": 9}), 400, "temperature"),
            (client.post("/v1/jobs", json={"model": MODEL}), 400, "messages"),
            (client.post("/v1/jobs", json=CHAT | {"model": "gpt-5"}), 404, "model"),
            (client.post("/v1/jobs", json=CHAT | {"n": 129}), 400, "n"),
            (client.post("/v1/jobs", json=CHAT | {"metadata": {"k": ["v"]}}), 400, "metadata.k"),
            (client.post("/v1/jobs", json=CHAT | {"bogus": 1}), 400, "bogus"),
            (client.post("/v1/jobs", json=CHAT | {"stream": True}), 400, "stream"),
        ]
        for response, status, param in cases:
            assert response.status_code == status, response.text
            assert response.json()["error"]["param"] == param
        oversize = client.post("/v1/jobs", content=b"{" + b" " * 2_000_000 + b"}",
                               headers={"Content-Type": "application/json"})
        assert oversize.status_code == 413
    anonymous = httpx.post(f"{service.url}/v1/jobs", json=CHAT)
    assert anonymous.status_code == 401
    assert "Bearer" in anonymous.headers["WWW-Authenticate"]
    assert count_jobs(service.sessions) == 0
    assert service.records(expect=0, timeout=0.5) == []


def test_tenants_see_only_their_own_jobs(service: Service) -> None:
    """Another tenant's job is 404 to read or cancel and absent from lists."""
    with service.client() as acme, service.client(service.globex) as globex:
        job_id = acme.post("/v1/jobs", json=CHAT).json()["id"]
        assert globex.get(f"/v1/jobs/{job_id}").status_code == 404
        assert globex.post(f"/v1/jobs/{job_id}/cancel").status_code == 404
        assert globex.get("/v1/jobs").json()["data"] == []
        assert acme.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"


def test_list_pages_through_jobs_newest_first(service: Service) -> None:
    """Cursor pagination on PostgreSQL covers every job once, in order."""
    with service.client() as client:
        ids = [client.post("/v1/jobs", json=CHAT).json()["id"] for _ in range(7)]
        seen, after = [], None
        while True:
            params: dict[str, Any] = {"limit": 3} | ({"after": after} if after else {})
            page = client.get("/v1/jobs", params=params).json()
            seen += [job["id"] for job in page["data"]]
            after = page["last_id"]
            if not page["has_more"]:
                break
    assert seen == ids[::-1]


def test_over_the_rate_limit_is_429_with_retry_after(service: Service) -> None:
    """A burst past the per-tenant rate gets 429 and Retry-After; nothing extra is queued.

    One token per ten minutes, longer than the test may run: every submission after the
    first is refused however slowly the machine serves them."""
    s = service.settings.model_copy(update={"tenant_rate_limit_per_s": 1 / 600})
    with running_api(s) as url, httpx.Client(base_url=url, headers=service.acme.headers,
                                              timeout=30) as client:
        statuses = [client.post("/v1/jobs", json=CHAT).status_code for _ in range(3)]
        refused = client.post("/v1/jobs", json=CHAT)
    assert statuses == [202, 429, 429]
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert count_jobs(service.sessions) == 1


def test_cancel_tells_workers_and_wakes_long_polls(service: Service) -> None:
    """Cancelling publishes the cancel event workers listen to and ends waiting reads."""
    client_redis = redis.Redis.from_url(service.settings.redis_url)
    with service.client() as client, CancelSubscription(
            client_redis, prefix=service.settings.topic_prefix) as cancels:
        job_id = client.post("/v1/jobs", json=CHAT).json()["id"]
        timer = threading.Timer(0.5, lambda: client.post(f"/v1/jobs/{job_id}/cancel"))
        started = time.monotonic()
        timer.start()
        waited = client.get(f"/v1/jobs/{job_id}", params={"wait": 20})
        timer.join()
        assert waited.json()["status"] == "cancelled"
        assert time.monotonic() - started < 5
        assert cancels.poll(timeout=5) == [job_id]
        again = client.post(f"/v1/jobs/{job_id}/cancel")
        assert again.status_code == 200
    client_redis.close()


def test_long_poll_returns_promptly_on_the_completion_event(service: Service) -> None:
    """A worker's commit + event ends a 30 s long-poll within moments."""
    publisher = redis.Redis.from_url(service.settings.redis_url)

    def finish(job_id: str) -> None:
        time.sleep(0.5)
        with service.sessions() as session:
            complete_job(session, job_id=job_id,
                         result={"object": "chat.completion", "choices": []},
                         prompt_tokens=3, completion_tokens=1, cached_tokens=0,
                         first_token_at=None)
            session.commit()
        publish_job_done(publisher, prefix=service.settings.topic_prefix, job_id=job_id,
                         status=JobStatus.SUCCEEDED)

    with service.client() as client:
        job_id = client.post("/v1/jobs", json=CHAT).json()["id"]
        thread = threading.Thread(target=finish, args=(job_id,))
        started = time.monotonic()
        thread.start()
        job = client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
        thread.join()
    publisher.close()
    assert job["status"] == "succeeded"
    assert job["usage"]["total_tokens"] == 4
    assert time.monotonic() - started < 5


def test_broker_down_is_503_and_leaves_no_job(service: Service) -> None:
    """No broker at the address: 503 naming it, and the inserted row is withdrawn."""
    dead = service.settings.model_copy(update={"kafka_bootstrap_servers": "127.0.0.1:9"})
    with running_api(dead) as url:
        response = httpx.post(f"{url}/v1/jobs", json=CHAT, headers=service.acme.headers,
                              timeout=60)
        ready = httpx.get(f"{url}/readyz", timeout=30)
    assert response.status_code == 503
    assert "broker" in response.json()["error"]["message"]
    assert "Retry-After" in response.headers
    assert count_jobs(service.sessions) == 0
    assert ready.status_code == 503 and ready.json()["error"]["param"] == "broker"


def test_broker_lost_after_connecting_is_503_and_the_row_is_withdrawn(
    service: Service, tmp_path: Path
) -> None:
    """A private broker accepts one job, then dies: the next send is unacknowledged, 503."""
    port = free_port()
    broker = tansu_service(port=port, log_dir=tmp_path / "private-tansu")
    broker.start()
    try:
        s = service.settings.model_copy(update={"kafka_bootstrap_servers": f"127.0.0.1:{port}"})
        ensure_topics(s)
        with running_api(s) as url, httpx.Client(base_url=url, headers=service.acme.headers,
                                                  timeout=60) as client:
            assert client.post("/v1/jobs", json=CHAT).status_code == 202
            broker.stop()
            lost = client.post("/v1/jobs", json=CHAT)
    finally:
        broker.stop()
    assert lost.status_code == 503, lost.text
    assert count_jobs(service.sessions) == 1


def test_readyz_and_metrics_with_everything_up(service: Service) -> None:
    """Database, broker and Redis all answer; metrics count submissions by priority."""
    with service.client() as client:
        client.post("/v1/jobs", json=CHAT | {"priority": "high"})
        ready = client.get("/readyz")
        metrics = client.get("/metrics").text
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"database": "ok", "broker": "ok", "redis": "ok"}
    assert 'batchinfer_jobs_submitted_total{priority="high"}' in metrics


def test_official_openai_client_works_unchanged(service: Service, tmp_path: Path,
                                               smollm2_dir: Path) -> None:
    """`openai.OpenAI(base_url=.../v1)` against uvicorn + a worker on the real model."""
    worker = WorkerProcess(service.settings, tmp_path / "worker.log")
    try:
        client = openai.OpenAI(base_url=f"{service.url}/v1", api_key=service.acme.key,
                               max_retries=0, timeout=180)
        assert [m.id for m in client.models.list().data] == [MODEL]

        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8, temperature=0)
        chat = raw.parse()
        assert isinstance(chat, ChatCompletion), f"worker log:\n{worker.log_tail()}"
        assert chat.object == "chat.completion"
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content
        assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 8
        with service.client() as http:
            job = http.get(f"/v1/jobs/{raw.headers['x-job-id']}").json()
        assert job["priority"] == "high"
        assert job["result"] == raw.http_response.json()

        text = client.completions.create(model=MODEL, prompt="The capital of France is",
                                         max_tokens=5, temperature=0)
        assert isinstance(text, Completion)
        assert text.object == "text_completion" and text.choices[0].text

        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user",
                                                                      "content": "x"}])
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, n=129,
                                           messages=[{"role": "user", "content": "x"}])
        assert refused.value.param == "n"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{service.url}/v1", api_key="bi_wrong",
                          max_retries=0).models.list()
    finally:
        code = worker.stop()
    assert code == 0, f"worker exit code {code}; log:\n{worker.log_tail()}"
