"""Fault injection: `batchinfer up` outlives the death of each part it depends on.

Each test runs the whole embedded stack (tiny random-weight model, one worker) on a
fresh PostgreSQL database, submits jobs over HTTP, kills one part mid-stream (the broker,
Redis, PostgreSQL, a worker) while a client keeps submitting, and then checks:
- while the part is down, submissions are answered promptly: 202, or 503 with
  Retry-After when the job could not be handed over; a 503 leaves no row behind (and
  through the API alone, a refusal for a dead broker takes well under a second);
- the part comes back (restarted by `up`, or by the test for PostgreSQL) and the
  service accepts and runs jobs again;
- every accepted job ends `succeeded`, its result written exactly once (a trigger counts
  the writes), and `up` stops cleanly.
Times to recover are logged (`-o log_cli=true` shows them); docs/operations.md
records them.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import sqlalchemy as sa

from api.resources import PUBLISH_TIMEOUT_S, BrokerUnavailable, LazyProducer
from core.worker_ids import local_pid
from scheduler.embedded_services import free_port, tansu_service
from storage.db import create_db_engine, session_factory
from storage.migrate import upgrade
from tests.utils.api import count_jobs, make_tenant_key
from tests.utils.fault_stack import (
    FINISH_TIMEOUT_S,
    MODEL,
    RECOVERY_TIMEOUT_S,
    RESTART_BACKOFF_S,
    Stack,
    check_each_accepted_job_succeeded_once,
    count_result_writes,
    job_body,
    restarts_of,
    stop_up,
    survive,
)
from tests.utils.postgres import PostgresCluster, create_database, postgres_bin_dir
from tests.utils.service import running_api
from tests.utils.up_process import start_up

# Each test runs `batchinfer up` or a real model, several minutes on a loaded machine; its
# own waits end first, with their diagnostics.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

logger = logging.getLogger(__name__)

# Tokens of each job in the frozen-worker test: long enough that the worker is frozen
# while it holds some.
FROZEN_JOB_TOKENS = 400


@pytest.fixture
def tiny_up(tmp_path: Path, tiny_model: Path) -> Iterator[Callable[..., Stack]]:
    """Factory: `tiny_up(database_url, num_workers=1, **settings)` → `batchinfer up`
    serving the tiny model on it (settings: BATCHINFER_* overrides by setting name)."""
    made: list[Stack] = []

    def start(database_url: str, num_workers: int = 1, **overrides: str) -> Stack:
        env = {
            "BATCHINFER_MODEL": str(tiny_model),
            "BATCHINFER_SERVED_MODEL_NAME": MODEL,
            "BATCHINFER_DATABASE_URL": database_url,
            "BATCHINFER_TOPIC_PARTITIONS": "2",
            "BATCHINFER_KAFKA_SESSION_TIMEOUT_MS": "6000",
            "BATCHINFER_ENGINE_KV_CACHE_MEMORY_BYTES": str(32 * 1024 * 1024),
            "BATCHINFER_WORKER_MAX_INFLIGHT": "4",
            "BATCHINFER_ENGINE_MAX_NUM_SEQS": "4",
            "BATCHINFER_EMBEDDED_RESTART_BACKOFF_S": str(RESTART_BACKOFF_S),
            **{f"BATCHINFER_{name.upper()}": value for name, value in overrides.items()},
        }
        up = start_up(tmp_path / "data", free_port(), num_workers=num_workers,
                      log_path=tmp_path / "up.log", extra_env=env)
        # pre-ping: the PostgreSQL test restarts the server under this pool.
        stack = Stack(up, up.client(), sa.create_engine(database_url, pool_pre_ping=True))
        made.append(stack)
        count_result_writes(stack.db)
        return stack

    yield start
    for stack in made:
        stack.client.close()
        if stack.up.process.poll() is None:
            stack.up.kill_tree()
        stack.db.dispose()


def test_broker_killed_mid_stream(tiny_up: Callable[..., Stack], postgres_url: str) -> None:
    """SIGKILL the broker: no 202 for a job it cannot hand over, `up` restarts it, the
    queued jobs it lost are re-published, and everything accepted runs once."""
    stack = tiny_up(postgres_url)
    # The API writes submissions in groups, one group at a time: a group whose records
    # were sent as the broker died waits for their acks (the broker is back within the
    # publish timeout, and they are delivered), and the submissions behind it wait with
    # it. So a short outage may be all 202s, a little late, and a refusal may take up to
    # the publish timeout; test_api_refuses_at_once_while_the_broker_is_down shows the
    # refusal itself is immediate.
    times = survive(stack, fault="broker", inject=lambda: stack.up.kill_child("tansu"),
                     expect_refusals=False, refused_within_s=PUBLISH_TIMEOUT_S + 2)
    assert restarts_of(stack, "tansu") == 1
    log = stack.up.log_tail(200_000)
    assert "restarted tansu" in log and "broker restored" in log
    assert times["accepting_again_s"] < RECOVERY_TIMEOUT_S
    stop_up(stack)


def test_redis_killed_mid_stream(tiny_up: Callable[..., Stack], postgres_url: str) -> None:
    """SIGKILL Redis: submissions go on (it is a cache), `up` restarts it, jobs finish."""
    stack = tiny_up(postgres_url)
    survive(stack, fault="redis", inject=lambda: stack.up.kill_child("redis-server"),
             expect_refusals=False)
    assert restarts_of(stack, "redis") == 1
    stop_up(stack)


def test_worker_killed_mid_stream(tiny_up: Callable[..., Stack], postgres_url: str) -> None:
    """SIGKILL the inference worker: its supervisor starts another, which re-runs the
    jobs the dead one held."""
    stack = tiny_up(postgres_url)
    killed: list[int] = []
    survive(stack, fault="worker",
             inject=lambda: killed.append(stack.up.kill_child("workers.inference")),
             expect_refusals=False)
    assert stack.up.child("workers.inference").pid not in killed
    stop_up(stack)


def _pid_of(worker_id: str) -> int:
    """The pid in a worker id of this host (`<host>-<pid>-<token>`)."""
    pid = local_pid(worker_id)
    assert pid is not None, worker_id
    return pid


def _is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_frozen_worker_is_killed_and_replaced_and_its_jobs_finish_elsewhere(
        tiny_up: Callable[..., Stack], postgres_url: str) -> None:
    """SIGSTOP one of two workers mid-job: it stops stamping its liveness file, so `up`
    SIGKILLs it after the heartbeat timeout and starts another; its partitions move and
    the reconciler hands its jobs back, so every job finishes, once, on another worker."""
    timeout_s = 6.0
    stack = tiny_up(postgres_url, num_workers=2, worker_heartbeat_interval_s="1",
                    worker_heartbeat_timeout_s=str(timeout_s))
    first = {p.pid for p in _workers_of(stack)}
    job_ids = []
    for i in range(12):
        body = {**job_body(f"frozen-{i}"), "max_tokens": FROZEN_JOB_TOKENS}
        response = stack.client.post("/v1/jobs", json=body)
        assert response.status_code == 202, response.text
        job_ids.append(response.json()["id"])

    def running_on() -> dict[str, str]:
        with stack.db.connect() as connection:
            return dict(connection.execute(sa.text(
                "SELECT id, worker_id FROM jobs WHERE status = 'running'")).all())

    stack.wait_until("a job to run", lambda: bool(running_on()), FINISH_TIMEOUT_S)
    frozen_id = next(iter(running_on().values()))
    frozen_pid = _pid_of(frozen_id)
    assert frozen_pid in first
    os.kill(frozen_pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        held = [job_id for job_id, worker in running_on().items() if worker == frozen_id]
        stack.wait_until("the frozen worker to be killed", lambda: _is_gone(frozen_pid),
                         FINISH_TIMEOUT_S)
        killed_s = time.monotonic() - frozen_at
        stack.wait_until("every job to finish", lambda: set(stack.statuses().values())
                         == {"succeeded"}, FINISH_TIMEOUT_S, describe=stack.unfinished)
        done_s = time.monotonic() - frozen_at
    finally:
        if not _is_gone(frozen_pid):
            os.kill(frozen_pid, signal.SIGKILL)
    check_each_accepted_job_succeeded_once(stack, job_ids)
    with stack.db.connect() as connection:
        finished_by: dict[str, str] = dict(connection.execute(sa.text(
            "SELECT id, worker_id FROM jobs WHERE id = ANY(:ids)"), {"ids": held}).all())
    assert held and all(worker != frozen_id for worker in finished_by.values()), finished_by
    stack.wait_until("a replacement worker", lambda: len(_workers_of(stack)) == 2,
                     RECOVERY_TIMEOUT_S)
    assert frozen_pid not in {p.pid for p in _workers_of(stack)}
    log = stack.up.log_tail(200_000)
    assert "gave no sign of life" in log, log[-6000:]
    logger.warning("frozen worker (heartbeat timeout %.0fs): killed after %.1fs, its %d "
                   "job(s) and the rest done after %.1fs", timeout_s, killed_s, len(held),
                   done_s)
    stop_up(stack)


def _workers_of(stack: Stack) -> list[psutil.Process]:
    """The live inference worker processes under `up`."""
    return stack.up.running("workers.inference")


@pytest.fixture
def own_postgres() -> Iterator[PostgresCluster]:
    """A PostgreSQL cluster of this test's own, which it may kill, with durable commits.

    The shared test cluster runs with fsync and synchronous_commit off, so a crash there
    loses transactions that had already committed: a worker's stored results would
    vanish after it acknowledged them, which no service can make up for.
    """
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.fail("PostgreSQL binaries not found: install the `postgresql` Debian package")
    cluster = PostgresCluster(bin_dir)
    cluster.start()
    try:
        cluster.pg_ctl("-m", "fast", "-w", "stop")
        cluster.start_durable()
        yield cluster
    finally:
        cluster.stop()


def test_postgres_killed_mid_stream(tiny_up: Callable[..., Stack],
                                    own_postgres: PostgresCluster) -> None:
    """Crash PostgreSQL (immediate shutdown) and start it again: 503s while it is down,
    then every accepted job runs once; the worker rides the outage out with its model
    loaded, never restarted."""
    stack = tiny_up(create_database(own_postgres.admin_url))
    worker = stack.up.child("workers.inference")
    survive(
        stack, fault="postgres",
        inject=lambda: own_postgres.pg_ctl("-m", "immediate", "stop"),
        restore=own_postgres.start_durable,
        expect_refusals=True)
    assert stack.up.child("workers.inference").pid == worker.pid, stack.up.log_tail(12000)
    stop_up(stack)


def test_stop_with_a_dead_broker_takes_seconds(tiny_up: Callable[..., Stack],
                                               postgres_url: str) -> None:
    """SIGTERM right after the broker died: the API refuses at once and `up` exits in
    seconds (offset commits and the consumer's close give up quickly)."""
    stack = tiny_up(postgres_url)
    stack.submit(2, "last")
    stack.wait_until("the jobs to finish",
                     lambda: set(stack.statuses().values()) == {"succeeded"}, FINISH_TIMEOUT_S,
                     describe=stack.unfinished)
    stack.up.kill_child("tansu")
    stopped_in = stop_up(stack, is_broker_up=False)
    logger.warning("stop with a dead broker took %.1fs", stopped_in)
    assert stopped_in < 30, stack.up.log_tail()


def _wait(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_producer_refuses_at_once_while_its_broker_is_down(tmp_path: Path,
                                                           settings: Any) -> None:
    """The API's producer: a dead broker is noticed without a send, get() then refuses
    without waiting, and once a broker answers on the address again the producer
    reconnects and the job topics are back; refuse() is for good."""
    port = free_port()
    broker = tansu_service(port=port, log_dir=tmp_path)
    broker.start()
    s = settings(kafka_bootstrap_servers=f"127.0.0.1:{port}")
    producer = LazyProducer(s, check_interval_s=0.1)
    try:
        assert producer.unavailable_reason is None
        producer.get()
        assert broker.pid is not None
        os.kill(broker.pid, signal.SIGKILL)
        _wait("the producer to notice", lambda: producer.unavailable_reason is not None)
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="stopped accepting connections"):
            producer.get()
        assert time.monotonic() - started < 1.0

        broker.start()  # empty: no topics until the producer creates them again
        _wait("the producer to reconnect", lambda: producer.unavailable_reason is None)
        kafka = producer.get()
        topic = s.job_topics["normal"]
        assert kafka.send(topic, b"after the restart").get(timeout=30).topic == topic
        assert len(kafka.partitions_for(topic)) == s.topic_partitions

        producer.refuse("the service is shutting down")
        with pytest.raises(BrokerUnavailable, match="shutting down"):
            producer.get()
        assert producer.unavailable_reason == "the service is shutting down"
    finally:
        producer.close()
        broker.stop()


def test_api_refuses_at_once_while_the_broker_is_down(settings: Any, tmp_path: Path) -> None:
    """Through the real API: once its broker is gone, a submission is a 503 with
    Retry-After within a second or so (not after the 10 s publish timeout), and leaves no
    row; when a broker answers on the address again, submissions are accepted."""
    port = free_port()
    broker = tansu_service(port=port, log_dir=tmp_path / "tansu")
    broker.start()
    s = settings(kafka_bootstrap_servers=f"127.0.0.1:{port}")
    upgrade(s.database_url)
    db = create_db_engine(s.database_url)
    sessions = session_factory(db)
    acme = make_tenant_key(sessions, "acme")
    body = {"model": s.served_model_name, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with running_api(s) as url, httpx.Client(base_url=url, headers=acme.headers,
                                                  timeout=60) as client:
            assert client.post("/v1/jobs", json=body).status_code == 202
            assert broker.pid is not None
            os.kill(broker.pid, signal.SIGKILL)
            _wait("/readyz to name the broker",
                  lambda: client.get("/readyz").json().get("error", {}).get("param") == "broker")
            started = time.monotonic()
            refused = client.post("/v1/jobs", json=body)
            refused_in = time.monotonic() - started
            assert refused.status_code == 503, refused.text
            assert refused.headers["Retry-After"] == "1"
            assert "broker" in refused.json()["error"]["message"]
            assert refused_in < 3.0, refused_in
            assert count_jobs(sessions) == 1

            broker.start()
            _wait("/readyz to answer 200", lambda: client.get("/readyz").status_code == 200)
            assert client.post("/v1/jobs", json=body).status_code == 202
            assert count_jobs(sessions) == 2
    finally:
        broker.stop()
        db.dispose()
