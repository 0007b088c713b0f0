"""`GET /v1/cache/stats`: a tenant sees its own jobs' figures; only an admin tenant sees
every worker's counters (once every tenant saw the service-wide figures)."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from storage.cache_stats import publish_cache_stats
from storage.jobs import complete_job, create_job
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.utils.api import TenantKey


def _succeed(sessions: sessionmaker[Session], tenant: TenantKey, *, cached: Any,
             prompt_tokens: int, cached_tokens: int) -> None:
    with sessions() as session:
        job = create_job(session, tenant_id=tenant.tenant_id, priority="normal", model=MODEL,
                         kind="chat.completion", request={"messages": []})
        result: dict[str, Any] = {"object": "chat.completion"}
        if cached is not None:
            result["cached"] = cached
        complete_job(session, job_id=job.id, result=result, prompt_tokens=prompt_tokens,
                     completion_tokens=1, cached_tokens=cached_tokens, first_token_at=None)
        session.commit()


def _publish_worker(client: TestClient) -> None:
    app: Any = client.app
    resources = app.state.resources
    publish_cache_stats(resources.redis, prefix=resources.settings.topic_prefix,
                        worker_id="w-secret", model=MODEL, updated_at=time.time(),
                        counters={"exact": {"hits": 1000, "misses": 7}}, ttl_s=60)


def test_a_tenant_sees_only_its_own_jobs_figures(
    client: TestClient, acme: TenantKey, globex: TenantKey, sessions: sessionmaker[Session],
) -> None:
    _succeed(sessions, acme, cached="exact", prompt_tokens=10, cached_tokens=0)
    _succeed(sessions, acme, cached={"kind": "semantic", "similarity": 0.99,
                                     "matched_job_id": "j"}, prompt_tokens=10, cached_tokens=0)
    _succeed(sessions, acme, cached=None, prompt_tokens=20, cached_tokens=16)
    _succeed(sessions, globex, cached="exact", prompt_tokens=5, cached_tokens=0)
    _publish_worker(client)
    stats = client.get("/v1/cache/stats", headers=acme.headers).json()
    assert stats["scope"] == "tenant"
    assert stats["workers"] == []
    totals = stats["totals"]
    assert (totals["exact"]["hits"], totals["exact"]["misses"]) == (1, 1)
    assert (totals["semantic"]["hits"], totals["semantic"]["misses"]) == (1, 1)
    assert (totals["kv"]["hits"], totals["kv"]["misses"]) == (16, 24)
    other = client.get("/v1/cache/stats", headers=globex.headers).json()
    assert other["totals"]["exact"]["hits"] == 1
    assert "w-secret" not in str(other) and other["totals"]["exact"]["misses"] == 0


def test_an_admin_tenant_sees_every_worker(
    make_client: ClientFactory, acme: TenantKey, globex: TenantKey,
) -> None:
    client = make_client(admin_tenants=["acme"])
    _publish_worker(client)
    stats = client.get("/v1/cache/stats", headers=acme.headers).json()
    assert stats["scope"] == "service"
    assert [w["worker_id"] for w in stats["workers"]] == ["w-secret"]
    assert stats["totals"]["exact"]["hits"] == 1000
    assert client.get("/v1/cache/stats", headers=globex.headers).json()["scope"] == "tenant"
