"""`batchinfer up` restarted over a database that a crash left in a bad state.

The first run leaves a job `running` under a worker that no longer exists (as a SIGKILL
of the whole machine would) and a queued job whose text no message can carry (stored
before the API refused such text). The second run's start-up pass fails the poison job
with a reason instead of exiting, hands the stuck job back to the queue, and runs it.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from scheduler.embedded_services import free_port
from storage.db import create_db_engine, session_factory
from storage.jobs import create_job, get_job, mark_running
from storage.models import JobStatus, utcnow
from tests.utils.up_process import UpProcess, start_up, wait_for_status

# Each test runs `batchinfer up` or a real model, several minutes on a loaded machine; its
# own waits end first, with their diagnostics.
pytestmark = pytest.mark.timeout(900)

CHAT_JOB = {
    "model": "smollm2-135m-instruct",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 8,
    "temperature": 0,
}


def test_restart_fails_a_poison_row_and_runs_a_job_its_dead_worker_left_running(
    tmp_path: Path, up_runs: list[UpProcess]
) -> None:
    data_dir = tmp_path / "data"
    first = start_up(data_dir, free_port(), num_workers=0, log_path=tmp_path / "up1.log")
    up_runs.append(first)
    with first.client() as client:
        response = client.post("/v1/jobs", json=CHAT_JOB)
        assert response.status_code == 202, response.text
        stuck_id = response.json()["id"]
    assert first.stop() == 0, first.log_tail()

    # What a crash leaves behind, written straight into the embedded SQLite file.
    engine = create_db_engine(f"sqlite:///{data_dir / 'batchinfer.db'}")
    sessions = session_factory(engine)
    with sessions() as session:
        stuck = get_job(session, job_id=stuck_id)
        assert stuck is not None
        assert mark_running(session, job_id=stuck_id, worker_id="crashed-host-1234")
        poison = create_job(session, tenant_id=stuck.tenant_id, priority="normal",
                            model=stuck.model, kind="text_completion",
                            request={"prompt": "x\ud800y", "max_tokens": 4})
        poison.created_at = utcnow() - timedelta(minutes=5)  # first in line
        poison_id = poison.id
        session.commit()
    engine.dispose()

    second = start_up(data_dir, free_port(), num_workers=1, log_path=tmp_path / "up2.log")
    up_runs.append(second)
    second.wait_for_line("batchinfer is up", 5)
    with second.client() as client:
        done = wait_for_status(client, stuck_id, "succeeded", timeout=600)
        failed = client.get(f"/v1/jobs/{poison_id}").json()
    assert done["result"]["choices"][0]["message"]["content"]
    assert failed["status"] == "failed", failed
    assert failed["error"]["code"] == "unpublishable", failed
    assert second.stop() == 0, second.log_tail()

    engine = create_db_engine(f"sqlite:///{data_dir / 'batchinfer.db'}")
    with engine.connect() as connection:
        counts: dict[str, int] = dict(connection.execute(sa.text(
            "SELECT status, count(*) FROM jobs GROUP BY status")).all())
        workers = connection.execute(sa.text("SELECT count(*) FROM workers")).scalar_one()
    engine.dispose()
    assert counts == {JobStatus.SUCCEEDED.value: 1, JobStatus.FAILED.value: 1}, counts
    assert workers == 0, "the worker deleted its heartbeat row when up stopped it"
