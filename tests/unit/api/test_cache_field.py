"""The `cache` field of a request: stored for the worker when valid, a 400 naming it when not."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from storage.models import Job
from tests.unit.api.conftest import MODEL
from tests.utils.api import CHAT_BODY, TenantKey, count_jobs


def test_a_cache_policy_reaches_the_stored_request(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session]
) -> None:
    body = {"model": MODEL, **CHAT_BODY,
            "cache": {"mode": "semantic", "ttl": 600, "threshold": 0.97}}
    response = client.post("/v1/jobs", json=body, headers=acme.headers)
    assert response.status_code == 202, response.text
    assert response.json()["cached"] is None
    with sessions() as session:
        job = session.get(Job, response.json()["id"])
        assert job is not None
        assert job.request["cache"] == {"mode": "semantic", "ttl": 600, "threshold": 0.97}
    body["cache"] = {"mode": "semantic", "max_error": 0.02}
    response = client.post("/v1/jobs", json=body, headers=acme.headers)
    assert response.status_code == 202, response.text
    with sessions() as session:
        job = session.get(Job, response.json()["id"])
        assert job is not None and job.request["cache"] == body["cache"]


@pytest.mark.parametrize(
    ("cache", "param"),
    [
        ({"mode": "sometimes"}, "cache.mode"),
        ({"mode": "semantic", "threshold": 0.5}, "cache.threshold"),
        ({"mode": "semantic", "max_error": 0}, "cache.max_error"),
        ({"mode": "semantic", "max_error": 0.9}, "cache.max_error"),
        ({"mode": "semantic", "max_error": "0.01"}, "cache.max_error"),
        ({"mode": "semantic", "max_error": 0.01, "threshold": 0.97}, "cache"),
        ({"mode": "exact", "ttl": 0}, "cache.ttl"),
        ({"mode": "exact", "ttl": "60"}, "cache.ttl"),
        ({"mode": "exact", "store": True}, "cache.store"),
    ],
)
def test_a_bad_cache_policy_is_a_400_naming_the_field(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    cache: dict[str, Any], param: str,
) -> None:
    body = {"model": MODEL, **CHAT_BODY, "cache": cache}
    response = client.post("/v1/jobs", json=body, headers=acme.headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert count_jobs(sessions) == 0
