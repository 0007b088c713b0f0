"""`GET /v1/jobs` filters and totals, and `GET /v1/usage`, per tenant."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from storage.jobs import fail_job
from storage.models import Job
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.unit.api.test_jobs_api import finish
from tests.utils.api import CHAT_BODY, TenantKey


def _submit(client: TestClient, key: TenantKey, **fields: Any) -> str:
    body = {"model": MODEL, **CHAT_BODY, **fields}
    response = client.post("/v1/jobs", json=body, headers=key.headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _ids(client: TestClient, key: TenantKey, query: str) -> tuple[set[str], int]:
    response = client.get(f"/v1/jobs?{query}", headers=key.headers)
    assert response.status_code == 200, response.text
    page = response.json()
    return {job["id"] for job in page["data"]}, page["total"]


def test_jobs_filter_by_model_priority_metadata_batch_and_time(
        make_client: ClientFactory, acme: TenantKey, globex: TenantKey,
        sessions: sessionmaker[Session]) -> None:
    """Each filter narrows the list and its total; filters combine; another tenant's
    matching job never shows; an unknown parameter is a 400 naming it."""
    client = make_client(served_models=[MODEL, "other"])
    a = _submit(client, acme, priority="high", metadata={"team": "red", "run": "1"})
    b = _submit(client, acme, priority="low", metadata={"team": "blue"})
    c = _submit(client, acme, model="other", metadata={"team": "red"})
    _submit(client, globex, metadata={"team": "red"})
    with sessions() as session:  # as the batch fan-out would, and an older job
        session.execute(update(Job).where(Job.id == b).values(batch_id="batch_1"))
        session.execute(update(Job).where(Job.id == c).values(
            created_at=datetime.now(UTC) - timedelta(days=2)))
        session.commit()

    assert _ids(client, acme, "") == ({a, b, c}, 3)
    assert _ids(client, acme, f"model={MODEL}") == ({a, b}, 2)
    assert _ids(client, acme, "priority=high") == ({a}, 1)
    assert _ids(client, acme, "metadata.team=red") == ({a, c}, 2)
    assert _ids(client, acme, "metadata.team=red&metadata.run=1") == ({a}, 1)
    assert _ids(client, acme, "batch_id=batch_1") == ({b}, 1)
    day_ago = int(time.time()) - 86_400
    assert _ids(client, acme, f"created_before={day_ago}") == ({c}, 1)
    assert _ids(client, acme, f"created_after={day_ago}&metadata.team=red") == ({a}, 1)
    assert _ids(client, acme, "limit=1")[1] == 3  # the total counts beyond the page
    refused = client.get("/v1/jobs?team=red", headers=acme.headers)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "team"
    for twice, param in (("status=queued&status=succeeded", "status"),
                         ("metadata.team=red&metadata.team=blue", "metadata.team")):
        repeated = client.get(f"/v1/jobs?{twice}", headers=acme.headers)
        assert repeated.status_code == 400, repeated.text
        assert repeated.json()["error"]["param"] == param


def test_usage_sums_finished_jobs_per_model_and_day_for_the_tenant(
        make_client: ClientFactory, acme: TenantKey, globex: TenantKey,
        sessions: sessionmaker[Session]) -> None:
    """Two finished jobs of one model today sum their tokens; a queued job and another
    tenant's job are not counted."""
    client = make_client()
    for _ in range(2):
        finish(sessions, _submit(client, acme))
    _submit(client, acme)  # still queued
    finish(sessions, _submit(client, globex))
    usage = client.get("/v1/usage", headers=acme.headers).json()
    today = datetime.now(UTC).date().isoformat()
    assert usage["data"] == [{"date": today, "model": MODEL, "tenant_id": None, "num_jobs": 2,
                              "num_succeeded": 2, "num_errors": 0, "prompt_tokens": 8,
                              "completion_tokens": 4, "cached_tokens": 2, "total_tokens": 12}]
    assert usage["totals"] | {"date": None} == usage["data"][0] | {"date": None, "model": None}
    assert usage["end"] - usage["start"] == 30 * 86_400
    later = int(time.time()) + 3600
    assert client.get(f"/v1/usage?start={later}&end={later + 60}",
                      headers=acme.headers).json()["data"] == []
    assert client.get("/v1/usage?start=10&end=5", headers=acme.headers).status_code == 400


def test_usage_groups_counts_errors_and_has_an_admin_view(
        make_client: ClientFactory, acme: TenantKey, globex: TenantKey,
        sessions: sessionmaker[Session]) -> None:
    """group_by picks the keys; a failed job counts as an error; totals equal the sum of
    the stored jobs' tokens; only an admin key sees every tenant, grouped by tenant."""
    client = make_client(served_models=[MODEL, "other"], admin_tenants=["acme"])
    finish(sessions, _submit(client, acme))
    finish(sessions, _submit(client, acme, model="other"))
    failed = _submit(client, acme)
    with sessions() as session:
        assert fail_job(session, job_id=failed, error={"message": "no"})
        session.commit()
    finish(sessions, _submit(client, globex))

    by_model = client.get("/v1/usage?group_by=model", headers=acme.headers).json()
    assert [(b["model"], b["date"], b["num_jobs"], b["num_errors"]) for b in by_model["data"]
            ] == sorted([(MODEL, None, 2, 1), ("other", None, 1, 0)])
    with sessions() as session:
        stored = session.execute(
            select(func.sum(Job.prompt_tokens), func.sum(Job.completion_tokens),
                   func.sum(Job.cached_tokens), func.count())
            .where(Job.tenant_id == acme.tenant_id, Job.finished_at.is_not(None))).one()
    totals = by_model["totals"]
    assert (totals["prompt_tokens"], totals["completion_tokens"], totals["cached_tokens"],
            totals["num_jobs"]) == tuple(stored)
    prompt_tokens, completion_tokens = int(stored[0] or 0), int(stored[1] or 0)
    assert totals["total_tokens"] == prompt_tokens + completion_tokens

    service = client.get("/v1/usage?scope=service&group_by=tenant",
                         headers=acme.headers).json()
    assert {b["tenant_id"]: b["num_jobs"] for b in service["data"]} == {
        acme.tenant_id: 3, globex.tenant_id: 1}
    only = client.get("/v1/usage?scope=service&group_by=tenant&tenant=globex",
                      headers=acme.headers).json()
    assert [b["tenant_id"] for b in only["data"]] == [globex.tenant_id]
    denied = client.get("/v1/usage?scope=service", headers=globex.headers)
    assert denied.status_code == 403 and denied.json()["error"]["param"] == "scope"
    bad = client.get("/v1/usage?group_by=week", headers=acme.headers)
    assert bad.status_code == 400 and "cannot group usage by week" in bad.json()["error"]["message"]
    mine = client.get("/v1/usage?group_by=tenant", headers=globex.headers)
    assert mine.status_code == 400 and mine.json()["error"]["param"] == "group_by"
