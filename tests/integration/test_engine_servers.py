"""Workers driving an OpenAI-compatible engine server instead of loading the model.

The engine server is real: this service's own API in front of a worker of the tiny model
(a second service in the same database and broker, under the model's path as its name).
Between the two sits a small HTTP front (tests/utils/engine_server.py) that records the
requests and answers 503/429 first, drops them, or holds them open.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa
from openai.types.responses import Response

from api.job_state import cancel_and_announce
from core.kafka import ensure_topics
from core.messages import prompt_affinity_key
from scheduler.embedded_services import free_port
from storage.models import Job, JobStatus
from storage.token_streams import STARTED, StreamEntry, token_stream_key
from tests.utils.api import make_tenant_key
from tests.utils.child_process import ChildProcess
from tests.utils.engine_server import EngineServerFront, engine_server_front
from tests.utils.worker_service import Service, job_bodies
from workers.inference.engine_routing import ServerState, pick_server

pytestmark = pytest.mark.integration

REMOTE_NAME = "remote-tiny"


@contextmanager
def engine_server(service: Callable[..., Service], tmp_path: Path
                  ) -> Iterator[tuple[Service, str, str]]:
    """Our API and a worker of the tiny model: (its service, its /v1 URL, an API key)."""
    upstream = service()
    upstream.start_worker()
    key = make_tenant_key(upstream.sessions, "downstream-worker").key
    settings = upstream.settings.model_copy(update={"api_port": free_port(),
                                                    "api_host": "127.0.0.1"})
    # Forked warm (tests.utils.cli_process says why): its cold imports are not under test.
    api = ChildProcess(["api"], settings, tmp_path / "engine-server-api.log", warm=True)
    base = f"http://127.0.0.1:{settings.api_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or api.process.poll() is not None:
                pytest.fail(f"the engine server's API did not start\n{api.log_tail()}")
            time.sleep(0.2)
        yield upstream, f"{base}/v1", key
    finally:
        api.stop(10)


def front_service(settings: Callable[..., Any], upstream: Service, tmp_path: Path,
                  urls: list[str], **overrides: Any) -> Service:
    """A service whose workers serve the upstream's model as REMOTE_NAME through `urls`."""
    s = settings(served_model_name=REMOTE_NAME, engine_urls=urls,
                 engine_url_backoff_s=0.2, **overrides)
    ensure_topics(s)
    (tmp_path / "front").mkdir(exist_ok=True)
    return Service(s, upstream.sessions, upstream.tenant_id, tmp_path / "front", [])


@contextmanager
def worker_through_front(service: Callable[..., Service], settings: Callable[..., Any],
                         tmp_path: Path) -> Iterator[tuple[EngineServerFront, Service]]:
    """A worker serving REMOTE_NAME through a recording front of the engine server: (the
    front, the worker's service), the worker stopped on the way out."""
    with engine_server(service, tmp_path) as (upstream, url, key), \
            engine_server_front(url, model=upstream.settings.model) as front:
        down = front_service(settings, upstream, tmp_path, [front.url],
                             engine_url_api_key=key)
        down.start_worker()
        try:
            yield front, down
        finally:
            down.workers[0].stop()


def upstream_jobs(service: Service) -> list[Job]:
    """The jobs the engine server ran (its model's name is the tiny model's path)."""
    with service.sessions() as session:
        return list(session.scalars(sa.select(Job).where(Job.model == service.settings.model)))


def test_jobs_run_through_an_engine_server_that_is_busy_at_first(
    service: Callable[..., Service], settings: Callable[..., Any], tmp_path: Path
) -> None:
    """Results in our shape with the server's usage; 503 and 429 retried after Retry-After,
    never failing a job; vLLM's priority passed; the server's 400 fails the job with its
    message."""
    with engine_server(service, tmp_path) as (upstream, url, key), \
            engine_server_front(url, model=upstream.settings.model,
                                refusals=[(503, {"Retry-After": "1"}), (429, {})]) as front:
        down = front_service(settings, upstream, tmp_path, [front.url],
                             engine_url_api_key=key, engine_url_send_priority=True)
        down.start_worker()
        try:
            job_ids = down.submit("low", job_bodies(2, tag="remote", max_tokens=4,
                                                    ignore_eos=True))
            (refused,) = down.submit("normal", [{"messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 10**6}])
            # Two workers, an API and the front on a machine others share: room to wait.
            done = down.wait_terminal([*job_ids, refused], timeout=400)
        finally:
            down.workers[0].stop()
    for job_id in job_ids:
        job = done[job_id]
        assert job.status is JobStatus.SUCCEEDED, job.error
        result = job.result
        assert result is not None and result["model"] == REMOTE_NAME
        assert result["id"].endswith(job_id)
        (choice,) = result["choices"]
        assert choice["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == 4
        assert result["usage"]["total_tokens"] == result["usage"]["prompt_tokens"] + 4
    assert front.answered[:2] == [503, 429]
    assert front.answered.count(200) == 2  # each success forwarded once, after the back-off
    sent = front.requests
    assert all(r["model"] == upstream.settings.model for r in sent)
    assert {r["priority"] for r in sent} == {1, 2}  # normal and low, vLLM's way
    ran = [j for j in upstream_jobs(upstream) if j.status is JobStatus.SUCCEEDED]
    assert [j.priority for j in ran] == ["low", "low"]
    failed = done[refused]
    assert failed.status is JobStatus.FAILED
    assert failed.error is not None
    message = failed.error["message"]
    assert message.startswith("the engine server refused the request (400): ")
    assert "max_tokens" in message


# A schema whose language is finite: even the random-weight model completes it.
PICK: dict[str, Any] = {
    "type": "object", "properties": {"pick": {"enum": ["red", "green", "blue"]}},
    "required": ["pick"], "additionalProperties": False}
PICK_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "strict": True,
                                                       "schema": PICK}}


def test_responses_and_structured_outputs_run_through_an_engine_server(
    service: Callable[..., Service], settings: Callable[..., Any], tmp_path: Path
) -> None:
    """A schema-constrained chat job reaches the server with its `response_format` (its
    answer parses and keeps to the schema), and a /v1/responses job runs as its chat body
    and is stored as OpenAI's `response`, created when its job was."""
    with worker_through_front(service, settings, tmp_path) as (front, down):
        (chat,) = down.submit("normal", [{
            "messages": [{"role": "user", "content": "Pick a colour."}],
            "max_tokens": 40, "temperature": 0, "response_format": PICK_FORMAT}])
        (response,) = down.submit("normal", [{
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Pick one."}],
            "instructions": "Be brief.", "metadata": {"run": "9"}, "max_tokens": 40,
            "temperature": 0, "response_format": PICK_FORMAT}], kind="response")
        done = down.wait_terminal([chat, response], timeout=400)
    assert all(r["response_format"] == PICK_FORMAT for r in front.requests)
    assert all("instructions" not in r and "metadata" not in r for r in front.requests)
    chat_job = done[chat]
    assert chat_job.status is JobStatus.SUCCEEDED, chat_job.error
    assert chat_job.result is not None
    text = chat_job.result["choices"][0]["message"]["content"]
    assert json.loads(text)["pick"] in PICK["properties"]["pick"]["enum"]
    job = done[response]
    assert job.status is JobStatus.SUCCEEDED, job.error
    stored = Response.model_validate(job.result)
    assert (stored.id, stored.object, stored.model) == (f"resp_{response}", "response",
                                                        REMOTE_NAME)
    assert stored.created_at == int(job.created_at.timestamp())
    assert (stored.metadata, stored.instructions) == ({"run": "9"}, "Be brief.")
    assert json.loads(stored.output_text)["pick"] in PICK["properties"]["pick"]["enum"]


def test_a_streamed_job_hands_on_its_text_as_the_servers_chunks_come(
    service: Callable[..., Service], settings: Callable[..., Any], tmp_path: Path
) -> None:
    """A job with `stream` is asked of the server as a stream (usage included), and its
    text reaches the job's token stream chunk by chunk, joining to the stored result; a
    job with `n` 2 is asked whole."""
    with worker_through_front(service, settings, tmp_path) as (front, down):
        (streamed,) = down.submit("high", [{
            "messages": [{"role": "user", "content": "Tell me more."}], "max_tokens": 12,
            "ignore_eos": True, "temperature": 0, "stream": True}])
        (whole,) = down.submit("high", [{
            "prompt": "Tell me more:", "max_tokens": 4, "ignore_eos": True,
            "temperature": 1, "n": 2, "stream": True}])
        done = down.wait_terminal([streamed, whole], timeout=400)
    job = done[streamed]
    assert job.status is JobStatus.SUCCEEDED, job.error
    assert job.result is not None
    assert job.result["usage"]["completion_tokens"] == 12  # the stream's last chunk's
    text = job.result["choices"][0]["message"]["content"]
    [as_stream] = [r for r in front.requests if r.get("n") is None]
    [two_choices] = [r for r in front.requests if r.get("n") == 2]
    assert (as_stream["stream"], as_stream["stream_options"]) == (True, {"include_usage": True})
    assert "stream" not in two_choices  # n = 2: asked whole
    assert done[whole].status is JobStatus.SUCCEEDED, done[whole].error

    redis_client = redis.Redis.from_url(down.settings.redis_url)
    raw: Any = redis_client.xrange(token_stream_key(down.settings.topic_prefix, streamed))
    entries = [StreamEntry.parse(streamed, fields) for _, fields in raw]
    assert entries[0].event == STARTED
    pieces = [e for e in entries[1:] if e.text]
    assert len(pieces) > 1, "the text came in one piece, not as the server sent it"
    assert "".join(e.text for e in pieces) == text
    assert [e.offset for e in pieces] == [sum(len(p.text) for p in pieces[:i])
                                          for i in range(len(pieces))]
    assert entries[-1].finish_reason == "length"
    assert job.first_token_at is not None and job.finished_at is not None
    assert job.first_token_at <= job.finished_at


def test_cancel_closes_the_request_on_the_engine_server(
    service: Callable[..., Service], redis_client: Any, tiny_model: Path
) -> None:
    """A cancelled job's request is abandoned: its connection closes (vLLM then aborts)."""
    with engine_server_front(None, model=str(tiny_model)) as front:
        svc = service(served_model_name=REMOTE_NAME, engine_urls=[front.url])
        svc.start_worker()
        (job_id,) = svc.submit("high", job_bodies(1, tag="held", max_tokens=50))
        svc.wait_for("the request to reach the engine server", front.held.is_set)
        svc.wait_for("the job to run", lambda: svc.count_status([job_id],
                                                               JobStatus.RUNNING) == 1)
        with svc.sessions() as session:
            cancel_and_announce(session, redis_client, prefix=svc.settings.topic_prefix,
                                job_id=job_id, tenant_id=svc.tenant_id)
        svc.wait_for("the worker to close the held connection", front.closed.is_set, 60)
        (after,) = svc.submit("high", job_bodies(1, tag="after", max_tokens=5))
        svc.wait_for("the next job to reach the engine server",
                     lambda: len(front.requests) == 2)
    assert svc.jobs([job_id])[job_id].status is JobStatus.CANCELLED
    assert sent_of(front.requests[1]) == sent_of(job_bodies(1, tag="after", max_tokens=5)[0])


def test_jobs_keep_to_their_servers_by_prefix_and_skip_one_that_drops_them(
    service: Callable[..., Service], settings: Callable[..., Any], tmp_path: Path
) -> None:
    """Each prompt goes to the server its affinity key ranks first; a server dropping
    connections is backed off and its prompts go to the other one meanwhile."""
    with engine_server(service, tmp_path) as (upstream, url, key), \
            engine_server_front(url, model=upstream.settings.model) as first, \
            engine_server_front(url, model=upstream.settings.model) as second:
        fronts = {first.url: first, second.url: second}
        servers = [ServerState(u, max_concurrency=1) for u in fronts]

        def owner(body: dict[str, Any]) -> str:
            server = pick_server(prompt_affinity_key(body, REMOTE_NAME), servers, 0.0)
            assert server is not None
            return server.url

        bodies = job_bodies(40, tag="affinity", max_tokens=2)
        by_owner = {u: [b for b in bodies if owner(b) == u] for u in fronts}
        assert all(len(b) >= 5 for b in by_owner.values()), "40 prompts over two servers"
        down = front_service(settings, upstream, tmp_path, list(fronts), engine_url_api_key=key)
        down.start_worker()
        try:
            down.run_succeeded([*by_owner[first.url][:3], *by_owner[second.url][:3]])
            for u, front in fronts.items():
                assert prompts(front.requests) == prompts(by_owner[u][:3])
            second.down.set()
            moved = by_owner[second.url][3:5]
            down.run_succeeded(moved)
        finally:
            down.workers[0].stop()
    assert prompts(first.requests[3:]) == prompts(moved)
    assert prompts(second.requests[3:]) <= prompts(moved)  # tried there first, dropped
    assert second.requests[3:]


def prompts(bodies: list[dict[str, Any]]) -> set[str]:
    """The prompts of requests or job bodies, comparable."""
    return {str(sent_of(body)) for body in bodies}


def sent_of(body: dict[str, Any]) -> dict[str, Any]:
    """What the front sees of a job body: the prompt fields (for matching)."""
    return {"messages": body["messages"]} if "messages" in body else {"prompt": body["prompt"]}
