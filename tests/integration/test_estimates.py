"""Queue positions and ETAs through the real API, PostgreSQL and broker (no worker runs the
jobs: a heartbeat row stands for a measured worker, as a live one writes it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.kafka import ensure_topics
from core.settings import Settings
from storage.db import create_db_engine, session_factory
from storage.migrate import upgrade
from storage.workers import record_heartbeat
from tests.integration.test_api import CHAT, MODEL, Service
from tests.utils.api import make_tenant_key
from tests.utils.service import running_api


@pytest.fixture
def service(settings: Any, tmp_path: Path) -> Iterator[Service]:
    """Migrated PostgreSQL, the topics, two tenants and the API, re-reading loads often."""
    s: Settings = settings(topic_partitions=1, served_models=[MODEL],
                           tenant_rate_limit_per_s=1000.0, estimate_refresh_s=0.05)
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


def test_queued_jobs_report_their_place_and_times(service: Service) -> None:
    with service.client() as client:
        normal = [client.post("/v1/jobs", json=CHAT).json()["id"] for _ in range(4)]
        high = [client.post("/v1/jobs", json=CHAT | {"priority": "high"}).json()["id"]
                for _ in range(2)]

        # No worker has measured anything yet: positions, no times.
        view = client.get(f"/v1/jobs/{normal[0]}").json()
        assert view["status"] == "queued"
        assert view["queue_position"] == 2
        assert view["estimated_completion_at"] is None

        with service.sessions() as session:
            record_heartbeat(session, worker_id="w1", model=MODEL, tokens_per_s=100.0,
                             step_s=0.01)
            session.commit()
        time.sleep(0.1)  # past estimate_refresh_s: the next read sees the worker
        views = [client.get(f"/v1/jobs/{j}").json() for j in high + normal]
    assert [v["queue_position"] for v in views] == [0, 1, 2, 3, 4, 5]
    completions = [v["estimated_completion_at"] for v in views]
    assert all(c is not None for c in completions)
    assert completions == sorted(completions)
    now = time.time()
    # Nothing finished yet: 64 + 128 tokens a job at 100 tokens/s, 1.92 s each.
    assert completions[-1] - now == pytest.approx(6 * 1.92, abs=2.0)
    for v in views:
        assert v["estimated_start_at"] <= v["estimated_completion_at"]


def test_finished_jobs_carry_no_estimate(service: Service) -> None:
    with service.client() as client:
        job_id = client.post("/v1/jobs", json=CHAT).json()["id"]
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        view = client.get(f"/v1/jobs/{job_id}").json()
    assert view["status"] == "cancelled"
    assert view["queue_position"] is None and view["estimated_completion_at"] is None
