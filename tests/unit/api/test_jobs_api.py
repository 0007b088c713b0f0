"""The jobs resource: submit, replay, read, long-poll, list, cancel, tenant isolation."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from pydantic import TypeAdapter
from sqlalchemy import event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

import api.job_state
from api.schemas import JobPublic
from core.settings import Settings
from storage.events import publish_job_done, publish_jobs_done
from storage.jobs import complete_job
from storage.models import Job, JobStatus
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.utils.api import CHAT_BODY, RecordingProducer, TenantKey, count_jobs

VALID: dict[str, Any] = {"model": MODEL, **CHAT_BODY}
CHAT_RESULT: dict[str, Any] = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "Hello!"}}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
}


def finish(sessions: sessionmaker[Session], job_id: str) -> None:
    """Store a result for the job, as a worker would."""
    with sessions() as session:
        assert complete_job(session, job_id=job_id, result=CHAT_RESULT, prompt_tokens=4,
                            completion_tokens=2, cached_tokens=1, first_token_at=None)
        session.commit()


class OnceWaiting(threading.Thread):
    """Runs `action` once a long-poll of each job waits on the API's hub: an announcement
    made before would be heard first, and the poll would then read at once instead of
    being woken, which is not what the tests that use this check."""

    def __init__(self, client: TestClient, job_ids: list[str], action: Callable[[], Any],
                 timeout: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.hub = client.app.state.resources.done_hub  # type: ignore[attr-defined]
        self.job_ids, self.action, self.timeout = job_ids, action, timeout
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + self.timeout
            while not all(job_id in self.hub._waiters for job_id in self.job_ids):
                if time.monotonic() > deadline:
                    raise AssertionError(f"no long-poll of each of {self.job_ids} waited")
                time.sleep(0.01)
            self.action()
        except BaseException as e:  # re-raised on the test's thread by `check`
            self.error = e

    def check(self) -> None:
        """Joined; what the thread raised, raised here."""
        self.join(self.timeout + 30)
        assert not self.is_alive(), "the action never finished"
        if self.error is not None:
            raise self.error


def test_submit_is_202_with_location_links_and_a_published_row(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer,
) -> None:
    """The job is stored queued, stamped published, and described in the answer."""
    response = client.post("/v1/jobs", json=VALID | {"priority": "high",
                                                      "metadata": {"run": "7"}},
                           headers=acme.headers)
    assert response.status_code == 202
    job = response.json()
    assert job["object"] == "job"
    assert job["status"] == "queued"
    assert job["priority"] == "high"
    assert job["metadata"] == {"run": "7"}
    assert response.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert job["links"] == {"self": f"/v1/jobs/{job['id']}",
                            "cancel": f"/v1/jobs/{job['id']}/cancel"}
    with sessions() as session:
        row = session.get(Job, job["id"])
        assert row is not None
        assert row.status is JobStatus.QUEUED
        assert row.queued_at is not None
        assert row.tenant_id == acme.tenant_id
        assert row.request["messages"] == [{"role": "user", "content": "Say hello."}]
    assert len(producer.records) == 1


def test_idempotency_key_replays_and_conflicts(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer,
) -> None:
    """Same key + same body: the same job (200); same key + other body: 409."""
    headers = acme.headers | {"Idempotency-Key": "order-42"}
    first = client.post("/v1/jobs", json=VALID, headers=headers)
    assert first.status_code == 202
    reordered = dict(reversed(list(VALID.items())))
    replay = client.post("/v1/jobs", json=reordered, headers=headers)
    assert replay.status_code == 200
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["id"] == first.json()["id"]
    conflict = client.post("/v1/jobs", json=VALID | {"max_tokens": 9}, headers=headers)
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "idempotency_key_reused"
    assert "different request body" in conflict.json()["error"]["message"]
    # The same key on another endpoint: the message says so, not "a different body".
    text = {"model": VALID["model"], "prompt": "Say hello."}
    elsewhere = client.post("/v1/jobs", json=text, headers=headers)
    assert elsewhere.status_code == 409
    assert elsewhere.json()["error"]["code"] == "idempotency_key_reused"
    assert "chat.completion request" in elsewhere.json()["error"]["message"]
    assert count_jobs(sessions) == 1
    assert len(producer.records) == 1
    keyless = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    with sessions() as session:
        hashes = {job_id: session.get(Job, job_id).request_hash  # type: ignore[union-attr]
                  for job_id in (first.json()["id"], keyless)}
    # Only a keyed job's body is hashed: nothing else ever compares it.
    assert len(hashes[first.json()["id"]] or "") == 64 and hashes[keyless] is None


def test_idempotency_keys_are_per_tenant(
    client: TestClient, acme: TenantKey, globex: TenantKey
) -> None:
    """Two tenants may use the same key for different jobs."""
    a = client.post("/v1/jobs", json=VALID, headers=acme.headers | {"Idempotency-Key": "k"})
    b = client.post("/v1/jobs", json=VALID, headers=globex.headers | {"Idempotency-Key": "k"})
    assert a.status_code == b.status_code == 202
    assert a.json()["id"] != b.json()["id"]


def test_another_tenants_job_is_404(client: TestClient, acme: TenantKey,
                                    globex: TenantKey) -> None:
    """Reading or cancelling someone else's job looks exactly like a missing one."""
    job_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    for response in (client.get(f"/v1/jobs/{job_id}", headers=globex.headers),
                     client.post(f"/v1/jobs/{job_id}/cancel", headers=globex.headers),
                     client.get("/v1/jobs/job_missing", headers=globex.headers)):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "job_not_found"
    assert client.get("/v1/jobs", headers=globex.headers).json()["data"] == []
    assert client.get(f"/v1/jobs/{job_id}", headers=acme.headers).status_code == 200


@pytest.mark.parametrize("path", ["/v1/jobs/{}", "/v1/batches/{}", "/v1/files/{}",
                                  "/v1/responses/resp_{}"])
def test_a_kilobytes_long_id_is_not_echoed_whole(client: TestClient, acme: TenantKey,
                                                 path: str) -> None:
    response = client.get(path.format("x" * 10_000), headers=acme.headers)
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "xxxx" in message and len(message) <= 210, len(message)


def test_finished_job_carries_result_and_usage(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session]
) -> None:
    """The stored OpenAI object comes back untouched, with usage and timestamps."""
    job_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    finish(sessions, job_id)
    job = client.get(f"/v1/jobs/{job_id}", headers=acme.headers).json()
    assert job["status"] == "succeeded"
    assert job["result"] == CHAT_RESULT
    assert job["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                            "prompt_tokens_details": {"cached_tokens": 1}}
    assert job["finished_at"] >= job["created_at"]


def test_submit_and_read_answer_exactly_what_their_response_model_would(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session]
) -> None:
    """Both routes send a Response of their own (api.schemas.model_response): the bytes
    must be FastAPI's serialisation of the view, and OpenAPI must still describe it."""
    adapter = TypeAdapter(JobPublic)

    def as_fastapi_sends(body: bytes) -> bytes:
        return adapter.dump_json(adapter.validate_json(body), by_alias=True)

    submitted = client.post("/v1/jobs", json=VALID | {"metadata": {"k": "v"}},
                            headers=acme.headers)
    assert submitted.status_code == 202
    assert submitted.headers["content-type"] == "application/json"
    assert submitted.content == as_fastapi_sends(submitted.content)
    finish(sessions, submitted.json()["id"])
    read = client.get(f"/v1/jobs/{submitted.json()['id']}?wait=1", headers=acme.headers)
    assert read.status_code == 200 and read.json()["status"] == "succeeded"
    assert read.content == as_fastapi_sends(read.content)
    paths = client.get("/openapi.json").json()["paths"]
    for path, method, status in (("/v1/jobs", "post", "202"), ("/v1/jobs/{job_id}", "get", "200")):
        schema = paths[path][method]["responses"][status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/JobPublic"}


def test_pagination_walks_every_job_once_newest_first(client: TestClient,
                                                      acme: TenantKey) -> None:
    """limit/after pages cover all jobs without repeats; status filters."""
    ids = [client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
           for _ in range(5)]
    seen: list[str] = []
    after: str | None = None
    while True:
        query = "limit=2" + (f"&after={after}" if after else "")
        page = client.get(f"/v1/jobs?{query}", headers=acme.headers).json()
        assert page["object"] == "list"
        seen += [job["id"] for job in page["data"]]
        assert page["first_id"] == page["data"][0]["id"]
        after = page["last_id"]
        if not page["has_more"]:
            break
    assert seen == list(reversed(ids))
    client.post(f"/v1/jobs/{ids[0]}/cancel", headers=acme.headers)
    cancelled = client.get("/v1/jobs?status=cancelled", headers=acme.headers).json()
    assert [job["id"] for job in cancelled["data"]] == [ids[0]]
    bad = client.get("/v1/jobs?after=job_unknown", headers=acme.headers)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "after"


def test_cancel_queued_then_again_then_finished_is_409(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session]
) -> None:
    """Cancel works once and repeats harmlessly; a finished job cannot be cancelled."""
    job_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    first = client.post(f"/v1/jobs/{job_id}/cancel", headers=acme.headers)
    assert first.status_code == 200
    assert first.json()["status"] == "cancelled"
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=acme.headers).status_code == 200
    done_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    finish(sessions, done_id)
    late = client.post(f"/v1/jobs/{done_id}/cancel", headers=acme.headers)
    assert late.status_code == 409
    assert late.json()["error"]["code"] == "job_not_cancellable"


def test_long_poll_returns_when_the_completion_event_arrives(
    make_client: ClientFactory, make_settings: Any, acme: TenantKey,
    sessions: sessionmaker[Session],
) -> None:
    """GET ?wait=N answers within moments of the worker's commit + event, not after N."""
    client = make_client()
    settings: Settings = client.app.state.resources.settings  # type: ignore[attr-defined]
    job_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]

    def worker() -> None:
        finish(sessions, job_id)
        publisher = redis.Redis.from_url(settings.redis_url)
        publish_job_done(publisher, prefix=settings.topic_prefix, job_id=job_id,
                         status=JobStatus.SUCCEEDED)
        publisher.close()

    thread = OnceWaiting(client, [job_id], worker)  # the poll waits, then is woken
    started = time.monotonic()
    thread.start()
    response = client.get(f"/v1/jobs/{job_id}?wait=40", headers=acme.headers)
    elapsed = time.monotonic() - started
    thread.check()
    assert response.json()["status"] == "succeeded"
    assert elapsed < 20  # woken, far before the end of its wait


def test_a_grouped_announcement_answers_its_long_polls_from_one_read(
    make_client: ClientFactory, acme: TenantKey, sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's write announced as one message: the hub reads the waiting jobs' views in
    one query and each long-poll answers with its view, without a read of its own: not
    after the wake-up, and not before waiting either, as the jobs were stored by this
    process and nothing was heard of them since."""
    client = make_client()
    settings: Settings = client.app.state.resources.settings  # type: ignore[attr-defined]
    job_ids = [client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
               for _ in range(3)]
    single_reads: list[str] = []
    grouped_reads: list[list[str]] = []
    load_job, job_views = api.job_state.load_job, api.job_state.job_views

    def counted_load(*args: Any, **kwargs: Any) -> Any:
        single_reads.append(kwargs["job_id"])
        return load_job(*args, **kwargs)

    def counted_views(connection: Any, ids: list[str]) -> Any:
        grouped_reads.append(sorted(ids))
        return job_views(connection, ids)

    monkeypatch.setattr("api.job_state.load_job", counted_load)
    monkeypatch.setattr("api.job_state.job_views", counted_views)
    answers: dict[str, dict[str, Any]] = {}

    def long_poll(job_id: str) -> None:
        answers[job_id] = client.get(f"/v1/jobs/{job_id}?wait=20", headers=acme.headers).json()

    def worker() -> None:
        for job_id in job_ids:
            finish(sessions, job_id)
        publisher = redis.Redis.from_url(settings.redis_url)
        publish_jobs_done(publisher, prefix=settings.topic_prefix,
                          statuses=dict.fromkeys(job_ids, JobStatus.SUCCEEDED))
        publisher.close()

    # Announced only once every long-poll waits on the hub: one that came later would
    # read for itself (rightly), which is not what is tested here.
    announcer = OnceWaiting(client, job_ids, worker)
    announcer.start()
    polls = [threading.Thread(target=long_poll, args=(job_id,)) for job_id in job_ids]
    for poll in polls:
        poll.start()
    announcer.check()
    for poll in polls:
        poll.join(30)
    assert {job_id: (a["status"], a["result"]) for job_id, a in answers.items()} == (
        dict.fromkeys(job_ids, ("succeeded", CHAT_RESULT)))
    assert single_reads == []
    assert grouped_reads == [sorted(job_ids)]


def test_on_sqlite_a_long_poll_reads_the_job_on_the_event_loop(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No thread-pool hop per read (it cost more than the read), and the whole view comes
    back from the one read a finished job needs."""
    job_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    finish(sessions, job_id)
    announce_done(client, job_id)

    def no_hop(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the read went to the thread pool")

    monkeypatch.setattr("api.job_state.run_in_threadpool", no_hop)
    job = client.get(f"/v1/jobs/{job_id}?wait=20", headers=acme.headers).json()
    assert (job["status"], job["result"], job["usage"]["prompt_tokens_details"]) == (
        "succeeded", CHAT_RESULT, {"cached_tokens": 1})
    assert job["finished_at"] >= job["created_at"]
    assert client.get(f"/v1/jobs/{job_id}", headers=acme.headers).json() == job


def test_a_long_poll_reads_first_only_what_may_have_finished(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job stored here and unheard of since is waited for without a read before; once
    its completion was heard, a long-poll reads it at once, as does one of a job this
    process did not store (a restarted API, another process)."""
    hub = client.app.state.resources.done_hub  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while not hub.is_listening:  # before, the hub expects nothing
        assert time.monotonic() < deadline, "the hub never started listening"
        time.sleep(0.01)
    unheard, heard = (client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
                      for _ in range(2))
    reads: list[str] = []
    load_job = api.job_state.load_job

    def counted_load(*args: Any, **kwargs: Any) -> Any:
        reads.append(kwargs["job_id"])
        return load_job(*args, **kwargs)

    monkeypatch.setattr("api.job_state.load_job", counted_load)
    finish(sessions, heard)
    announce_done(client, heard)
    while hub.unheard(heard, acme.tenant_id):  # the hub hears it on the app's loop
        assert time.monotonic() < deadline, "the hub never heard the announcement"
        time.sleep(0.01)
    assert client.get(f"/v1/jobs/{heard}?wait=20", headers=acme.headers).json()["status"] == (
        "succeeded")
    assert reads == [heard]
    announcer = OnceWaiting(client, [unheard], lambda: announce_done(client, unheard))
    announcer.start()
    assert client.get(f"/v1/jobs/{unheard}?wait=20", headers=acme.headers).json()["status"] == (
        "queued")  # woken by the (test's false) announcement, then read once
    announcer.check()
    assert reads == [heard, unheard]
    other = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    hub.forget(other)
    finish(sessions, other)
    assert client.get(f"/v1/jobs/{other}?wait=20", headers=acme.headers).json()["status"] == (
        "succeeded")
    assert reads == [heard, unheard, other]


def test_a_long_poll_whose_announcement_is_lost_reads_the_job_meanwhile(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job finished with no announcement heard (a worker's publish failed alone): the
    long-poll answers within RECHECK_S, not at the end of its wait."""
    monkeypatch.setattr("api.job_state.RECHECK_S", 0.2)
    job_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    threading.Timer(0.3, finish, (sessions, job_id)).start()
    started = time.monotonic()
    response = client.get(f"/v1/jobs/{job_id}?wait=30", headers=acme.headers)
    assert response.json()["status"] == "succeeded"
    assert time.monotonic() - started < 10


def announce_done(client: TestClient, job_id: str) -> None:
    """Publish the job's completion as a worker does after its commit."""
    settings: Settings = client.app.state.resources.settings  # type: ignore[attr-defined]
    publisher = redis.Redis.from_url(settings.redis_url)
    try:
        publish_job_done(publisher, prefix=settings.topic_prefix, job_id=job_id,
                         status=JobStatus.SUCCEEDED)
    finally:
        publisher.close()


def test_long_poll_is_capped_and_returns_the_unfinished_job(
    make_client: ClientFactory, acme: TenantKey
) -> None:
    """wait beyond long_poll_max_s waits only that long, then shows the job as it is."""
    client = make_client(long_poll_max_s=0.5)
    job_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    started = time.monotonic()
    response = client.get(f"/v1/jobs/{job_id}?wait=30", headers=acme.headers)
    assert 0.5 <= time.monotonic() - started < 15  # the cap, not the 30 s asked for
    assert response.json()["status"] == "queued"


def test_cancel_wakes_a_long_poll(client: TestClient, acme: TenantKey) -> None:
    """A cancel publishes the done event, so a waiting reader returns at once."""
    job_id = client.post("/v1/jobs", json=VALID, headers=acme.headers).json()["id"]
    canceller = OnceWaiting(
        client, [job_id], lambda: client.post(f"/v1/jobs/{job_id}/cancel", headers=acme.headers))
    started = time.monotonic()
    canceller.start()
    response = client.get(f"/v1/jobs/{job_id}?wait=40", headers=acme.headers)
    canceller.check()
    assert response.json()["status"] == "cancelled"
    assert time.monotonic() - started < 20  # woken, far before the end of its wait


def test_unacknowledged_send_is_503_and_the_job_is_withdrawn(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer,
) -> None:
    """The broker refuses the record after the insert: 503, and no row is left behind."""
    producer.is_down = True
    response = client.post("/v1/jobs", json=VALID, headers=acme.headers)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"
    assert count_jobs(sessions) == 0
    producer.is_down = False
    assert client.post("/v1/jobs", json=VALID, headers=acme.headers).status_code == 202


def test_a_replay_of_a_key_whose_commit_failed_waits_for_its_row_to_be_withdrawn(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer,
) -> None:
    """The database dies mid-COMMIT yet keeps the row: the request hears 503, and a retry
    with the same Idempotency-Key must not adopt that row (it is withdrawn as soon as the
    database answers): 503 again until it is gone, then a job of its own."""
    resources = client.app.state.resources  # type: ignore[attr-defined]
    lost = OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))
    failing = {"commit": True, "delete": True}

    def answer_lost(session: Session) -> None:
        if failing["commit"]:
            failing["commit"] = False
            raise lost

    def still_down(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.lstrip().upper().startswith("DELETE") and failing["delete"]:
            raise lost

    event.listen(resources.sessions, "after_commit", answer_lost)
    event.listen(resources.sessions.kw["bind"], "before_cursor_execute", still_down)
    try:
        headers = acme.headers | {"Idempotency-Key": "order-7"}
        first = client.post("/v1/jobs", json=VALID, headers=headers)
        assert first.status_code == 503, first.text
        assert count_jobs(sessions) == 1, "the failed commit stored the row after all"
        retry = client.post("/v1/jobs", json=VALID, headers=headers)
        assert retry.status_code == 503, retry.text
        assert "Idempotency-Key" in retry.json()["error"]["message"]
        failing["delete"] = False  # the database answers again
        deadline = time.monotonic() + 30
        while count_jobs(sessions):
            assert time.monotonic() < deadline, "the doubtful row was never withdrawn"
            time.sleep(0.05)
        again = client.post("/v1/jobs", json=VALID, headers=headers)
        assert again.status_code == 202, again.text
        assert count_jobs(sessions) == 1 and len(producer.records) == 1
    finally:
        event.remove(resources.sessions, "after_commit", answer_lost)
        event.remove(resources.sessions.kw["bind"], "before_cursor_execute", still_down)
