"""Queue positions and ETAs through the real API, PostgreSQL and broker (no worker runs the
jobs: a heartbeat row stands for a measured worker, as a live one writes it)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.kafka import ensure_topics
from core.settings import Settings
from storage.db import create_db_engine, session_factory
from storage.jobs import mark_running
from storage.migrate import upgrade
from storage.models import utcnow
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


def _measured_worker(service: Service, tokens_per_s: float) -> None:
    with service.sessions() as session:
        record_heartbeat(session, worker_id="w1", model=MODEL, tokens_per_s=tokens_per_s,
                         step_s=0.01)
        session.commit()
    time.sleep(0.1)  # past estimate_refresh_s


def test_a_deadline_the_backlog_cannot_meet_is_refused_with_the_estimate(
    service: Service,
) -> None:
    with service.client() as client:
        for _ in range(10):
            assert client.post("/v1/jobs", json=CHAT).status_code == 202
        _measured_worker(service, tokens_per_s=10.0)  # 19.2 s a job
        # Low: behind the ten normal jobs, about 11 x 19.2 = 211 s away.
        late = CHAT | {"priority": "low", "deadline": 120}
        refused = client.post("/v1/jobs", json=late)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "deadline_unattainable" and error["param"] == "deadline"
        assert error["estimated_completion_at"] - time.time() == pytest.approx(211, abs=15)
        assert "on_unattainable" in error["message"]

        accepted = client.post("/v1/jobs", json=late | {"on_unattainable": "accept"})
        assert accepted.status_code == 202, accepted.text
        view = client.get(f"/v1/jobs/{accepted.json()['id']}").json()
        assert view["deadline"] - time.time() == pytest.approx(120, abs=5)
        # Normal with a deadline: before the ten without one, so it can make it.
        urgent = client.post("/v1/jobs", json=CHAT | {"deadline": 120})
        assert urgent.status_code == 202, urgent.text
        assert client.get(f"/v1/jobs/{urgent.json()['id']}").json()["queue_position"] == 0


def test_deadlines_outside_a_minute_to_seven_days_or_without_an_offset_are_400(
    service: Service,
) -> None:
    with service.client() as client:
        for deadline in (30, 8 * 86_400, "2030-01-01T00:00:00", "tomorrow"):
            response = client.post("/v1/jobs", json=CHAT | {"deadline": deadline})
            assert response.status_code == 400, (deadline, response.text)
            assert response.json()["error"]["param"].startswith("deadline"), deadline
        rfc3339 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
        assert client.post("/v1/jobs", json=CHAT | {"deadline": rfc3339}).status_code == 202


def test_a_batch_whose_window_the_fleet_cannot_meet_is_refused(service: Service) -> None:
    lines = "".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}})
        + "\n"
        for i in range(50)
    )
    with service.client() as client:
        file_id = client.post("/v1/files", data={"purpose": "batch"},
                              files={"file": ("in.jsonl", lines.encode())}).json()["id"]
        _measured_worker(service, tokens_per_s=1.0)  # 50 x 192 s: far beyond 30 minutes
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                "completion_window": "30m"}
        refused = client.post("/v1/batches", json=body)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "deadline_unattainable"
        assert refused.json()["error"]["param"] == "completion_window"
        roomy = client.post("/v1/batches", json=body | {"completion_window": "24h"})
        assert roomy.status_code == 200, roomy.text
        accepted = client.post("/v1/batches", json=body | {"on_unattainable": "accept"})
        assert accepted.status_code == 200, accepted.text


def test_running_jobs_count_by_the_work_their_worker_reports_left(service: Service) -> None:
    """50 running jobs whose engine reports 500 tokens left (a wave nearly done) at 100
    tokens/s: the last claimed finishes in 500 / 100 = 5 s and a queued job (64 prompt
    tokens, max_tokens 4) behind them in (500 + 68) / 100 = 5.7 s. Counted as whole jobs
    of 64 + 128 tokens, as before the workers reported their work, they were 49 x 192 +
    68 and 50 x 192 + 68 tokens away: 95 s and 97 s."""
    with service.client() as client:
        running = [client.post("/v1/jobs", json=CHAT).json()["id"] for _ in range(50)]
        with service.sessions() as session:
            for job_id in running:
                assert mark_running(session, job_id=job_id, worker_id="w1")
            session.commit()
        queued = client.post("/v1/jobs", json=CHAT).json()["id"]
        beat = utcnow()
        with service.sessions() as session:
            record_heartbeat(session, worker_id="w1", now=beat, model=MODEL,
                             tokens_per_s=100.0, step_s=0.01, num_requests_left=50,
                             num_tokens_to_compute=500, num_output_tokens_left=400)
            session.commit()
        time.sleep(0.1)  # past estimate_refresh_s
        last = client.get(f"/v1/jobs/{running[-1]}").json()
        behind = client.get(f"/v1/jobs/{queued}").json()
    assert last["status"] == "running" and behind["status"] == "queued"
    # From the beat: the pace since it is taken off what was reported, so however long
    # the reads took, the work ends 5 s after the beat (while that is still ahead).
    assert last["estimated_completion_at"] - beat.timestamp() == pytest.approx(5.0, abs=0.5)
    assert behind["estimated_completion_at"] - beat.timestamp() == pytest.approx(5.68, abs=0.5)
