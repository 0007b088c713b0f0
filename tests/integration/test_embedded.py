"""`batchinfer up` end to end: a job over HTTP, clean shutdown, re-publish after restart.

The embedded default runs its own broker, Redis and SQLite, so these tests need none of
the session's services; they share only the models directory (the model is pulled once).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest

from scheduler.embedded_services import free_port
from tests.utils.budget import within_budget
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


def _running(proc: psutil.Process) -> bool:
    """Not yet exited. A zombie has exited: only its reaping is left, which after `up`
    is gone falls to init, and a container's init may take its time."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {proc.status()} ppid {proc.ppid()} {proc.cmdline()}"
    except psutil.Error as error:
        return f"{proc.pid} {error!r}"


def _stop_and_check_no_orphans(run: UpProcess) -> None:
    children = run.descendants()
    assert children, "up should run child processes (broker, Redis, workers)"
    assert run.stop() == 0, run.log_tail()
    # A process that imported torch takes seconds to exit on a busy machine (the fork
    # server leaves once its last child has); what must not happen is one staying.
    deadline = time.monotonic() + 60
    while alive := [proc for proc in children if _running(proc)]:
        assert time.monotonic() < deadline, \
            f"orphans after SIGTERM: {[_describe(proc) for proc in alive]}"
        time.sleep(0.2)
    run.wait_for_line("stopped", 5)


def test_up_serves_a_job_and_stops_cleanly(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    """A job submitted over HTTP succeeds; SIGTERM stops every process of the tree."""
    run = start_up(tmp_path / "data", free_port(), num_workers=1,
                   log_path=tmp_path / "up.log")
    up_runs.append(run)
    assert run.api_key.startswith("bi_")
    assert (tmp_path / "data" / "batchinfer.db").exists()
    with run.client() as client:
        assert client.get("/healthz").status_code == 200
        response = client.post("/v1/jobs", json=CHAT_JOB)
        assert response.status_code == 202, response.text
        job = wait_for_status(client, response.json()["id"], "succeeded", timeout=400)
    assert job["result"]["object"] == "chat.completion"
    assert job["result"]["choices"][0]["message"]["content"]
    assert job["usage"]["completion_tokens"] > 0
    _stop_and_check_no_orphans(run)


def _api_processes(run: UpProcess) -> list[psutil.Process]:
    """The tree's processes listening on the API port: up itself and its extra APIs."""
    found = []
    for proc in [psutil.Process(run.process.pid), *run.descendants()]:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == run.port
                   for c in proc.net_connections(kind="tcp")):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def _listeners_become(run: UpProcess, count: int, timeout: float = 120.0) -> list[psutil.Process]:
    deadline = time.monotonic() + within_budget(timeout)
    while len(found := _api_processes(run)) != count:
        assert time.monotonic() < deadline, f"{len(found)} API listeners, not {count}"
        time.sleep(0.2)
    return found


def test_up_serves_its_port_from_several_api_processes(tmp_path: Path,
                                                       up_runs: list[UpProcess]) -> None:
    """--api-processes 3: two supervised API processes share up's port; submissions on
    fresh connections all land; one killed is restarted; SIGTERM stops every one."""
    run = start_up(tmp_path / "data", free_port(), num_workers=0, log_path=tmp_path / "up.log",
                   args=["--api-processes", "3"])
    up_runs.append(run)
    listeners = _listeners_become(run, 3)
    extra = [p for p in listeners if p.pid != run.process.pid]
    assert all("-m api" in " ".join(p.cmdline()) for p in extra)

    def submit_on_fresh_connections(n: int) -> list[str]:
        ids = []
        for _ in range(n):
            with run.client() as client:  # a new connection: the kernel picks a listener
                response = client.post("/v1/jobs", json=CHAT_JOB)
                assert response.status_code == 202, response.text
                ids.append(response.json()["id"])
        return ids

    accepted = submit_on_fresh_connections(30)
    extra[0].kill()
    extra[0].wait(10)  # its listener is gone once it is
    accepted += submit_on_fresh_connections(10)  # the others serve meanwhile
    restarted = _listeners_become(run, 3)
    assert extra[0].pid not in {p.pid for p in restarted}
    accepted += submit_on_fresh_connections(10)
    with run.client() as client:
        listed = client.get("/v1/jobs", params={"limit": 100}).json()
    assert {job["id"] for job in listed["data"]} >= set(accepted)
    _stop_and_check_no_orphans(run)


def test_second_start_republishes_a_job_left_queued(tmp_path: Path,
                                                    up_runs: list[UpProcess]) -> None:
    """With no workers the job stays queued; the next start re-publishes and runs it."""
    data_dir = tmp_path / "data"
    first = start_up(data_dir, free_port(), num_workers=0, log_path=tmp_path / "up1.log")
    up_runs.append(first)
    with first.client() as client:
        response = client.post("/v1/jobs", json=CHAT_JOB)
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        time.sleep(1.0)
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
    _stop_and_check_no_orphans(first)

    second = start_up(data_dir, free_port(), num_workers=1, log_path=tmp_path / "up2.log")
    up_runs.append(second)
    assert second.api_key == first.api_key, "the dev key survives a restart"
    banner = second.wait_for_line("batchinfer is up", 5)
    match = re.search(r"(\d+) queued job\(s\) re-published", banner)
    assert match and int(match.group(1)) == 1, banner
    with second.client() as client:
        job = wait_for_status(client, job_id, "succeeded", timeout=400)
    assert job["result"]["choices"][0]["message"]["content"]
    _stop_and_check_no_orphans(second)


def test_up_autoscales_workers_by_lag(tmp_path: Path, up_runs: list[UpProcess]) -> None:
    """From no workers: a queued job starts one, which runs it; the cooldown after its
    offset is committed, the worker is drained again."""
    log_path = tmp_path / "up.log"
    run = start_up(tmp_path / "data", free_port(), num_workers=0, max_workers=1,
                   log_path=log_path,
                   extra_env={"BATCHINFER_AUTOSCALE_INTERVAL_S": "0.5",
                              "BATCHINFER_AUTOSCALE_COOLDOWN_S": "2"})
    up_runs.append(run)
    assert "0-1 autoscaled worker(s)" in run.wait_for_line("batchinfer is up", 5)
    with run.client() as client:
        response = client.post("/v1/jobs", json=CHAT_JOB)
        assert response.status_code == 202, response.text
        wait_for_status(client, response.json()["id"], "succeeded", timeout=400)
    deadline = time.monotonic() + 60
    while "worker-0 drained" not in (log := log_path.read_text(errors="replace")):
        assert time.monotonic() < deadline, run.log_tail()
        time.sleep(0.2)
    # "autoscaling workers of <model> 0 → 1: ..." (each served model has its autoscaler)
    assert re.search(r"autoscaling workers of \S+ 0 → 1", log), log
    assert re.search(r"autoscaling workers of \S+ 1 → 0", log), log
    _stop_and_check_no_orphans(run)


def test_up_refuses_a_port_in_use(tmp_path: Path) -> None:
    """A busy API port is reported before anything starts."""
    import socket
    import subprocess
    import sys

    from tests.utils.up_process import ROOT

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "cli", "up", "--port", str(port), "--data-dir",
             str(tmp_path / "data")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2
    assert f"port {port}" in result.stderr and "already in use" in result.stderr
