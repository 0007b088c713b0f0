"""The hostile-input sweep: 500 requests no service should run, against the real app.

Bodies (nested past the bound, malformed, every field wrong), headers, private callback
URLs in every spelling, broken uploads, and a batch file of broken lines. Every answer
is below 500 and in the error shape, no request leaves a traceback in the log, and
nothing refused is stored: no job row, no broker record, no file, no file bytes.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from scheduler.batches import BatchRunner
from storage.batches import BatchStatus, get_batch
from storage.files import FileStore
from tests.unit.api.conftest import ClientFactory
from tests.unit.api.hostile_cases import encode
from tests.unit.api.hostile_sweep_cases import (
    CHAT,
    batch_lines,
    endpoint_bodies,
    header_cases,
    job_bodies,
    upload_forms,
)
from tests.unit.api.test_requests_refused import assert_error_shape
from tests.utils.api import RecordingProducer, TenantKey, count_jobs

JSON = {"Content-Type": "application/json"}


class Sweep:
    """Sends cases and checks each answer; counts what was sent and what was accepted."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.num_sent = 0
        self.num_accepted = 0
        self.wrong: list[tuple[int, str, str]] = []  # (status, case, answer)

    def check(self, response: Any, case: object, *, may_accept: bool = False) -> None:
        """Note the answer; a 5xx, an acceptance not allowed, or a shapeless error is wrong."""
        self.num_sent += 1
        status = response.status_code
        if status < 400:
            self.num_accepted += 1
        if status >= 500 or (status < 400 and not may_accept):
            self.wrong.append((status, repr(case)[:200], response.text[:200]))
        elif status >= 400:
            assert_error_shape(response.json())


@pytest.fixture
def sweep_client(make_client: ClientFactory) -> TestClient:
    # A synchronous completion that slipped through would wait for a worker: not long.
    return make_client(sync_request_timeout_s=0.5, webhook_allowlist=[],
                       max_request_bytes=2 * 1024 * 1024)


def test_no_hostile_request_is_a_5xx_a_traceback_or_stored(
    sweep_client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, caplog: pytest.LogCaptureFixture,
) -> None:
    client = sweep_client
    sweep = Sweep(client)
    with caplog.at_level(logging.INFO):
        for body in job_bodies():
            for headers in (acme.headers, {}):
                sweep.check(client.post("/v1/jobs", content=body, headers=JSON | headers),
                            body)
        for path, body in endpoint_bodies():
            sweep.check(client.post(path, content=body, headers=JSON | acme.headers), body)
        for case in header_cases():
            sent: Any = JSON | acme.headers | case if isinstance(case, dict) else case
            sweep.check(client.post("/v1/jobs", content=encode(CHAT), headers=sent), case,
                        may_accept=True)
        for content_type, body in upload_forms():
            sweep.check(client.post("/v1/files", content=body, headers=acme.headers | {
                "Content-Type": content_type.decode("latin-1")}), body)
    assert sweep.wrong == []
    assert sweep.num_sent >= 400
    unexpected = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert unexpected == [], [r.getMessage()[:200] for r in unexpected][:5]
    assert count_jobs(sessions) == sweep.num_accepted
    assert len(producer.records) == sweep.num_accepted
    assert client.get("/v1/files", headers=acme.headers).json()["data"] == []
    app: Any = client.app
    root = FileStore.from_settings(app.state.resources.settings).root
    assert list(root.iterdir()) == []


def test_a_batch_of_hostile_lines_fails_validation_naming_each_line(
    sweep_client: TestClient, acme: TenantKey, producer: RecordingProducer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The scheduler's own loop, on the app's database and file store."""
    client = sweep_client
    lines = batch_lines()
    content = b"\n".join(lines) + b"\n"
    uploaded = client.post("/v1/files", headers=acme.headers, data={"purpose": "batch"},
                           files={"file": ("hostile.jsonl", content, "application/jsonl")})
    assert uploaded.status_code == 200, uploaded.text
    created = client.post("/v1/batches", headers=acme.headers, json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert created.status_code == 200, created.text
    app: Any = client.app
    resources = app.state.resources
    runner = BatchRunner(resources.settings, resources.sessions, producer,  # type: ignore[arg-type]
                         resources.redis, FileStore.from_settings(resources.settings))
    with caplog.at_level(logging.INFO):
        runner.step()
    with resources.sessions() as session:
        batch = get_batch(session, batch_id=created.json()["id"], tenant_id=acme.tenant_id)
        assert batch is not None
        assert batch.status is BatchStatus.FAILED
        named = {error["line"] for error in batch.errors or []}
    assert named == set(range(1, len(lines) + 1))
    assert [r for r in caplog.records if r.exc_info] == []
    assert producer.records == []
