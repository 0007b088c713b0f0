"""Files and Batches routes: OpenAI objects, streaming upload limits, 409s, isolation."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from openai.types import Batch, FileObject
from sqlalchemy.orm import Session, sessionmaker

import api.routes.batches as batches_route
from core.settings import Settings
from storage.batches import BatchStatus, get_batch
from storage.events import publish_batch_done
from storage.workers import record_heartbeat
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.utils.api import TenantKey

CHAT = "/v1/chat/completions"
LINE = {"custom_id": "r1", "method": "POST", "url": CHAT,
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}
CONTENT = (json.dumps(LINE) + "\n").encode()


def upload(client: TestClient, tenant: TenantKey, content: bytes = CONTENT,
           purpose: str = "batch") -> Any:
    """POST /v1/files as the openai client does (multipart, purpose before file)."""
    return client.post("/v1/files", headers=tenant.headers, data={"purpose": purpose},
                       files={"file": ("in.jsonl", content, "application/jsonl")})


def create(client: TestClient, tenant: TenantKey, file_id: str, **extra: Any) -> Any:
    """POST /v1/batches with OpenAI's fields plus `extra`."""
    body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **extra}
    return client.post("/v1/batches", headers=tenant.headers, json=body)


def test_file_round_trip(client: TestClient, acme: TenantKey) -> None:
    response = upload(client, acme)
    assert response.status_code == 200, response.text
    file = FileObject.model_validate(response.json())
    assert (file.bytes, file.filename, file.purpose) == (len(CONTENT), "in.jsonl", "batch")
    got = client.get(f"/v1/files/{file.id}", headers=acme.headers).json()
    assert got["id"] == file.id
    content = client.get(f"/v1/files/{file.id}/content", headers=acme.headers)
    assert content.status_code == 200 and content.content == CONTENT
    listed = client.get("/v1/files", headers=acme.headers).json()
    assert [f["id"] for f in listed["data"]] == [file.id] and listed["has_more"] is False
    assert listed["first_id"] == listed["last_id"] == file.id
    deleted = client.delete(f"/v1/files/{file.id}", headers=acme.headers).json()
    assert deleted == {"id": file.id, "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{file.id}", headers=acme.headers).status_code == 404


def test_upload_refusals(make_client: ClientFactory, acme: TenantKey) -> None:
    client = make_client(max_file_bytes=200)
    too_big = upload(client, acme, content=b"x" * 5000)
    assert too_big.status_code == 413
    assert too_big.json()["error"]["code"] == "file_too_large"
    wrong_purpose = upload(client, acme, purpose="fine-tune")
    assert wrong_purpose.status_code == 400
    assert wrong_purpose.json()["error"]["param"] == "purpose"
    not_multipart = client.post("/v1/files", headers=acme.headers, content=b"{}")
    assert not_multipart.status_code == 400
    assert client.get("/v1/files", headers=acme.headers).json()["data"] == []


def test_streamed_upload_over_the_limit_is_cut_off(make_client: ClientFactory,
                                                   acme: TenantKey) -> None:
    client = make_client(max_file_bytes=1000)

    def body() -> Any:
        yield b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\n"
        for _ in range(100):
            yield b"y" * 100
        yield b"\r\n--b--\r\n"

    # No Content-Length (chunked): the limit is enforced while the bytes stream in.
    response = client.post("/v1/files", headers={**acme.headers,
                                                 "Content-Type": "multipart/form-data; "
                                                 "boundary=b"}, content=body())
    assert response.status_code == 413
    assert client.get("/v1/files", headers=acme.headers).json()["data"] == []


def test_files_are_private_to_their_tenant(client: TestClient, acme: TenantKey,
                                           globex: TenantKey) -> None:
    file_id = upload(client, acme).json()["id"]
    for method, path in (("GET", f"/v1/files/{file_id}"), ("GET", f"/v1/files/{file_id}/content"),
                         ("DELETE", f"/v1/files/{file_id}")):
        assert client.request(method, path, headers=globex.headers).status_code == 404
    assert create(client, globex, file_id).status_code == 404


def test_batch_create_get_list_cancel(client: TestClient, acme: TenantKey,
                                      sessions: sessionmaker[Session]) -> None:
    file_id = upload(client, acme).json()["id"]
    response = create(client, acme, file_id, metadata={"run": "1"})
    assert response.status_code == 200, response.text
    batch = Batch.model_validate(response.json())
    assert batch.status == "validating" and batch.metadata == {"run": "1"}
    assert batch.expires_at is not None and batch.expires_at - batch.created_at == 86_400
    assert response.json()["priority"] == "low"
    got = Batch.model_validate(client.get(f"/v1/batches/{batch.id}", headers=acme.headers)
                               .json())
    assert got.id == batch.id
    # An active batch's input cannot be deleted.
    conflict = client.delete(f"/v1/files/{file_id}", headers=acme.headers)
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "file_in_use"

    cancelled = client.post(f"/v1/batches/{batch.id}/cancel", headers=acme.headers)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
    with sessions() as session:
        stored = get_batch(session, batch_id=batch.id)
        assert stored is not None and stored.status is BatchStatus.CANCELLING
        stored.move_to(BatchStatus.CANCELLED)
        session.commit()
    again = client.post(f"/v1/batches/{batch.id}/cancel", headers=acme.headers)
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    assert client.delete(f"/v1/files/{file_id}", headers=acme.headers).status_code == 200


def test_a_create_that_loses_the_race_for_its_key_gets_the_winners_batch(
        client: TestClient, acme: TenantKey, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests with one key at once: both look the key up before either inserts; the
    loser's insert meets the unique index (at the flush) and answers the winner's batch."""
    file_id = upload(client, acme).json()["id"]
    key = {"Idempotency-Key": "raced"}
    body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    winner = client.post("/v1/batches", headers=acme.headers | key, json=body)
    lookups: list[object] = []
    real_lookup = batches_route.find_batch_by_idempotency_key

    def lookup_before_the_winner_committed(*args: Any, **kwargs: Any) -> Any:
        lookups.append(args)
        return None if len(lookups) == 1 else real_lookup(*args, **kwargs)

    monkeypatch.setattr(batches_route, "find_batch_by_idempotency_key",
                        lookup_before_the_winner_committed)
    loser = client.post("/v1/batches", headers=acme.headers | key, json=body)
    assert loser.status_code == 200, loser.text
    assert loser.headers["Idempotent-Replayed"] == "true"
    assert loser.json()["id"] == winner.json()["id"]
    assert len(lookups) == 2


def test_a_retried_create_with_its_idempotency_key_gets_the_same_batch(
        client: TestClient, acme: TenantKey, sessions: sessionmaker[Session]) -> None:
    """The same key and body: the first batch again, marked replayed (one batch in all);
    a field written out at its default is the same body; another body is a 409; another
    tenant's key space is its own."""
    file_id = upload(client, acme).json()["id"]
    key = {"Idempotency-Key": "nightly-2026-11-30"}
    body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    first = client.post("/v1/batches", headers=acme.headers | key, json=body)
    assert first.status_code == 200 and "Idempotent-Replayed" not in first.headers
    again = client.post("/v1/batches", headers=acme.headers | key,
                        json=body | {"priority": "low"})
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    listed = client.get("/v1/batches", headers=acme.headers).json()["data"]
    assert [b["id"] for b in listed] == [first.json()["id"]]
    other = client.post("/v1/batches", headers=acme.headers | key,
                        json=body | {"completion_window": "48h"})
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert other.json()["error"]["param"] == "Idempotency-Key"
    unkeyed = client.post("/v1/batches", headers=acme.headers, json=body)
    assert unkeyed.json()["id"] != first.json()["id"]


def test_batch_list_pages_with_cursor(client: TestClient, acme: TenantKey) -> None:
    file_id = upload(client, acme).json()["id"]
    ids = [create(client, acme, file_id).json()["id"] for _ in range(3)]
    first = client.get("/v1/batches", params={"limit": 2}, headers=acme.headers).json()
    assert first["has_more"] is True and first["last_id"] == ids[1]
    rest = client.get("/v1/batches", params={"limit": 2, "after": first["last_id"]},
                      headers=acme.headers).json()
    assert [b["id"] for b in first["data"] + rest["data"]] == ids[::-1]
    assert rest["has_more"] is False


def test_batch_create_refusals(client: TestClient, acme: TenantKey) -> None:
    file_id = upload(client, acme).json()["id"]
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"input_file_id": "file-nope"}, 404, "input_file_id"),
        ({"completion_window": "30s"}, 400, "completion_window"),
        ({"completion_window": "8d"}, 400, "completion_window"),
        ({"completion_window": "1w"}, 400, "completion_window"),
        # Digits that are not ASCII: "²" once leaked int()'s own message, "１" was taken.
        ({"completion_window": "\u00b2h"}, 400, "completion_window"),
        ({"completion_window": "\uff11h"}, 400, "completion_window"),
        ({"completion_window": "\u0661h"}, 400, "completion_window"),
        ({"endpoint": "/v1/assistants"}, 400, "endpoint"),
        ({"model": "gpt-4o"}, 404, "model"),
        ({"priority": "urgent"}, 400, "priority"),
        ({"callback_url": "ftp://example.com/x"}, 400, "callback_url"),
        # Named where it was sent.
        ({"metadata": {"callback_url": "http://10.0.0.1/hook"}}, 400, "metadata.callback_url"),
    ]
    for overrides, status_code, param in cases:
        body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h",
                **overrides}
        response = client.post("/v1/batches", headers=acme.headers, json=body)
        assert response.status_code == status_code, (overrides, response.text)
        assert response.json()["error"]["param"] == param, overrides
    assert client.get("/v1/batches", headers=acme.headers).json()["data"] == []


def test_any_completion_window_from_a_minute_to_seven_days(client: TestClient,
                                                          acme: TenantKey) -> None:
    file_id = upload(client, acme).json()["id"]
    for window, seconds in (("1m", 60), ("30m", 1800), ("2h", 7200), ("7d", 7 * 86_400)):
        batch = create(client, acme, file_id, completion_window=window).json()
        assert batch["completion_window"] == window
        assert batch["expires_at"] - batch["created_at"] in (seconds - 1, seconds, seconds + 1)


def test_short_completion_windows_when_allowed(make_client: ClientFactory,
                                               acme: TenantKey) -> None:
    client = make_client(batch_completion_windows=["24h", "5s"])
    file_id = upload(client, acme).json()["id"]
    batch = create(client, acme, file_id, completion_window="5s").json()
    assert batch["expires_at"] - batch["created_at"] in (4, 5, 6)


def test_cancelling_a_finished_batch_is_a_conflict(client: TestClient, acme: TenantKey,
                                                   sessions: sessionmaker[Session]) -> None:
    file_id = upload(client, acme).json()["id"]
    batch_id = create(client, acme, file_id).json()["id"]
    with sessions() as session:
        stored = get_batch(session, batch_id=batch_id)
        assert stored is not None
        stored.move_to(BatchStatus.FAILED)
        session.commit()
    response = client.post(f"/v1/batches/{batch_id}/cancel", headers=acme.headers)
    assert response.status_code == 409
    assert client.post("/v1/batches/batch_nope/cancel", headers=acme.headers).status_code == 404


def end_later(sessions: sessionmaker[Session], settings: Settings, batch_id: str,
              delay_s: float) -> threading.Thread:
    """Fail the batch after `delay_s` and announce it, as the batch loop does."""
    def run() -> None:
        time.sleep(delay_s)
        with sessions() as session:
            stored = get_batch(session, batch_id=batch_id)
            assert stored is not None
            stored.move_to(BatchStatus.FAILED)
            session.commit()
        publisher = redis.Redis.from_url(settings.redis_url)
        publish_batch_done(publisher, prefix=settings.topic_prefix, batch_id=batch_id,
                           status="failed")
        publisher.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_batch_long_poll_answers_when_the_batch_ends(
        client: TestClient, acme: TenantKey, globex: TenantKey,
        sessions: sessionmaker[Session]) -> None:
    """GET ?wait=N answers within moments of the batch loop's commit and announcement;
    a wait that ends first answers the batch as it is; unknown and other tenants' batches
    are 404 at once, waiting or not."""
    settings: Settings = client.app.state.resources.settings  # type: ignore[attr-defined]
    batch_id = create(client, acme, upload(client, acme).json()["id"]).json()["id"]

    started = time.monotonic()
    still = client.get(f"/v1/batches/{batch_id}?wait=0.5", headers=acme.headers)
    assert still.status_code == 200 and still.json()["status"] == "validating"
    assert 0.4 < time.monotonic() - started < 3

    thread = end_later(sessions, settings, batch_id, delay_s=0.5)
    started = time.monotonic()
    ended = client.get(f"/v1/batches/{batch_id}?wait=20", headers=acme.headers)
    elapsed = time.monotonic() - started
    thread.join(10)
    assert ended.status_code == 200 and ended.json()["status"] == "failed"
    assert 0.4 < elapsed < 3

    started = time.monotonic()
    assert client.get(f"/v1/batches/{batch_id}?wait=20",
                      headers=acme.headers).json()["status"] == "failed"
    for tenant, some_id in ((acme, "batch_nope"), (globex, batch_id)):
        missing = client.get(f"/v1/batches/{some_id}?wait=20", headers=tenant.headers)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "batch_id"
    assert time.monotonic() - started < 2
    refused = client.get(f"/v1/batches/{batch_id}?wait=-1", headers=acme.headers)
    assert refused.status_code == 400


def test_batches_in_progress_are_listed_with_their_estimate(
        make_client: ClientFactory, acme: TenantKey, sessions: sessionmaker[Session]) -> None:
    """The list carries the same `estimated_completion_at` as the batch itself (the batch
    CLI's ETA column); a batch not in progress has none."""
    client = make_client(estimate_refresh_s=0.01)
    running = create(client, acme, upload(client, acme).json()["id"]).json()["id"]
    waiting = create(client, acme, upload(client, acme).json()["id"]).json()["id"]
    with sessions() as session:
        stored = get_batch(session, batch_id=running)
        assert stored is not None
        stored.model, stored.num_requests = MODEL, 100
        stored.move_to(BatchStatus.IN_PROGRESS)
        record_heartbeat(session, worker_id="w1", model=MODEL, tokens_per_s=1000.0,
                         step_s=0.01)
        session.commit()
    time.sleep(0.05)  # past estimate_refresh_s
    listed = {b["id"]: b for b in client.get("/v1/batches", headers=acme.headers)
              .json()["data"]}
    one = client.get(f"/v1/batches/{running}", headers=acme.headers).json()
    # 100 lines of 64 + 128 tokens (nothing finished yet) at 1,000 tokens/s: 19.2 s.
    assert one["estimated_completion_at"] - time.time() == pytest.approx(19.2, abs=2)
    assert listed[running]["estimated_completion_at"] == pytest.approx(
        one["estimated_completion_at"], abs=1)
    assert listed[waiting].get("estimated_completion_at") is None
