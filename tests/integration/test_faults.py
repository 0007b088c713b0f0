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
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
from tests.utils.postgres import PostgresCluster, create_database, postgres_bin_dir
from tests.utils.service import running_api
from tests.utils.up_process import UpProcess, start_up

# Each test runs `batchinfer up` or a real model, several minutes on a loaded machine; its
# own waits end first, with their diagnostics.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

logger = logging.getLogger(__name__)

MODEL = "tiny"
# Each job decodes this many tokens: long enough that a fault lands mid-stream, short
# enough that a loaded CPU runs a dozen in seconds.
MAX_TOKENS = 48
NUM_JOBS_BEFORE = 8
# A restarted dependency should have the service accepting jobs again well within this.
RECOVERY_TIMEOUT_S = 90.0
FINISH_TIMEOUT_S = 150.0
# Long enough that the client sees the outage; `up` would otherwise restart the broker
# or Redis in about a second.
RESTART_BACKOFF_S = 2.0
# Tokens of each job in the frozen-worker test: long enough that the worker is frozen
# while it holds some.
FROZEN_JOB_TOKENS = 400
# A submission unanswered this long counts as hung (the checks then fail).
SUBMIT_TIMEOUT_S = 30.0
# The API checks the broker four times a second; a second covers a loaded machine.
FAULT_NOTICED_WITHIN_S = 1.0


@dataclass(frozen=True, slots=True)
class Answer:
    """One submission's answer, as the client saw it."""

    status_code: int
    sent_at: float
    elapsed_s: float
    job_id: str | None
    retry_after: str | None


@dataclass
class Submitter:
    """Submits one distinct job every interval_s, each from its own thread (so one slow
    answer does not hide the others), recording every answer."""

    client: httpx.Client
    tag: str
    interval_s: float = 0.2
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        """Begin submitting."""
        self._threads.append(threading.Thread(target=self._run, name="submitter",
                                              daemon=True))
        self._threads[0].start()

    def stop(self) -> None:
        """Stop submitting and wait for every answer."""
        self._stop.set()
        # The runner first: until it has returned it may start one more submission,
        # whose thread a list taken earlier would miss (its job then had a row and, when
        # read, no answer yet).
        runner, *_ = self._threads
        runner.join(SUBMIT_TIMEOUT_S)
        assert not runner.is_alive(), "the submitter's runner did not stop"
        for thread in self._threads[1:]:
            thread.join(SUBMIT_TIMEOUT_S + 5)

    def accepted_since(self, moment: float) -> int:
        """202s for submissions sent after moment."""
        return sum(a.status_code == 202 for a in self.answers if a.sent_at > moment)

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(self.interval_s):
            thread = threading.Thread(target=self._submit, args=(f"{self.tag}-{i}",),
                                      daemon=True)
            self._threads.append(thread)
            thread.start()
            i += 1

    def _submit(self, tag: str) -> None:
        sent_at = time.monotonic()
        try:
            response = self.client.post("/v1/jobs", json=_body(tag), timeout=SUBMIT_TIMEOUT_S)
        except httpx.TransportError:
            # No answer at all: recorded as status 0, which the checks refuse.
            self.answers.append(Answer(0, sent_at, time.monotonic() - sent_at, None, None))
            return
        job_id = response.json()["id"] if response.status_code == 202 else None
        self.answers.append(Answer(response.status_code, sent_at, time.monotonic() - sent_at,
                                   job_id, response.headers.get("retry-after")))


def _body(tag: str) -> dict[str, Any]:
    """A distinct greedy chat request (distinct: no result-cache hits)."""
    return {"model": MODEL, "messages": [{"role": "user", "content": f"fault test {tag}"}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


@dataclass
class Stack:
    """A running `batchinfer up`, a client on it, and its database."""

    up: UpProcess
    client: httpx.Client
    db: sa.Engine

    def statuses(self) -> dict[str, str]:
        """Job id → status of every job row."""
        with self.db.connect() as connection:
            return dict(connection.execute(sa.text("SELECT id, status FROM jobs")).all())

    def submit(self, n: int, tag: str) -> list[str]:
        """n jobs that must be accepted (nothing is broken yet); their ids."""
        ids = []
        for i in range(n):
            response = self.client.post("/v1/jobs", json=_body(f"{tag}-{i}"))
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
        return ids

    def unfinished(self) -> list[tuple[object, ...]]:
        """Where each job not yet finished stands: what a stuck run must name."""
        with self.db.connect() as connection:
            return [tuple(row) for row in connection.execute(sa.text(
                "SELECT id, status, priority, attempts, worker_id, queued_at, started_at, "
                "first_token_at FROM jobs "
                "WHERE status NOT IN ('succeeded', 'failed', 'cancelled') ORDER BY created_at"))]

    def wait_until(self, what: str, check: Callable[[], bool], timeout: float,
                   describe: Callable[[], object] | None = None) -> float:
        """Poll check until true; the seconds it took. Fails with the log (and what describe
        says) after timeout."""
        started = time.monotonic()
        while not check():
            if time.monotonic() - started > timeout:
                state = f"\nstate: {describe()}" if describe is not None else ""
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what};"
                                     f"{state}\nlog:\n{self.up.log_tail(12000)}")
            time.sleep(0.2)
        return time.monotonic() - started


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
        _count_result_writes(stack.db)
        return stack

    yield start
    for stack in made:
        stack.client.close()
        if stack.up.process.poll() is None:
            stack.up.kill_tree()
        stack.db.dispose()


def _count_result_writes(db: sa.Engine) -> None:
    """A trigger that records every UPDATE leaving a job row `succeeded`."""
    with db.begin() as connection:
        connection.execute(sa.text("CREATE TABLE result_writes (job_id text NOT NULL)"))
        connection.execute(sa.text(
            "CREATE FUNCTION record_result() RETURNS trigger AS $$ BEGIN "
            "INSERT INTO result_writes (job_id) VALUES (NEW.id); RETURN NEW; END $$ "
            "LANGUAGE plpgsql"))
        connection.execute(sa.text(
            "CREATE TRIGGER jobs_result_writes AFTER UPDATE ON jobs FOR EACH ROW "
            "WHEN (NEW.status = 'succeeded' AND OLD.status <> 'succeeded') "
            "EXECUTE FUNCTION record_result()"))


def _survive(stack: Stack, *, fault: str, inject: Callable[[], object],
             restore: Callable[[], object] | None = None,
             expect_refusals: bool,
             refused_within_s: float = PUBLISH_TIMEOUT_S / 2) -> dict[str, float]:
    """Jobs in flight, inject the fault (then restore it), check everything the module
    docstring promises; the seconds each recovery step took."""
    before = stack.submit(NUM_JOBS_BEFORE, f"{fault}-before")
    stack.wait_until("a job to run", lambda: "running" in stack.statuses().values()
                     or "succeeded" in stack.statuses().values(), RECOVERY_TIMEOUT_S)
    submitter = Submitter(stack.up.client(), tag=f"{fault}-during")
    submitter.start()
    try:
        injected_at = time.monotonic()
        inject()
        if restore is not None:
            time.sleep(RESTART_BACKOFF_S)  # the same outage `up` leaves itself
            restore()
        # Serving again: every dependency answers, and three jobs were accepted after the
        # last refusal.
        def accepting() -> bool:
            refused = [a.sent_at for a in submitter.answers if a.status_code != 202]
            return submitter.accepted_since(max(refused, default=injected_at)) >= 3
        stack.wait_until(f"/readyz to answer 200 after the {fault} fault",
                         lambda: stack.client.get("/readyz").status_code == 200,
                         RECOVERY_TIMEOUT_S)
        ready_again_s = time.monotonic() - injected_at
        stack.wait_until(f"submissions to be accepted again after the {fault} fault",
                         accepting, RECOVERY_TIMEOUT_S)
    finally:
        submitter.stop()
        submitter.client.close()
    answers = submitter.answers
    refused = [a for a in answers if a.status_code != 202]
    assert all(a.status_code == 503 for a in refused), [a.status_code for a in refused]
    assert all(a.retry_after is not None and int(a.retry_after) >= 1 for a in refused)
    # Refused promptly. Only a request whose record was sent before the fault was noticed
    # may wait for its ack. (An accepted job's answer may take longer: it waits for its ack.)
    noticed_by = injected_at + FAULT_NOTICED_WITHIN_S
    slow = [a for a in refused if a.sent_at > noticed_by and a.elapsed_s > refused_within_s]
    assert not slow, slow
    if expect_refusals:
        assert refused, f"no submission was refused while the {fault} was down"
    last_refusal = max((a.sent_at for a in refused), default=injected_at)
    after = stack.submit(3, f"{fault}-after")
    accepted = before + [a.job_id for a in answers if a.job_id is not None] + after
    finished_in = stack.wait_until(
        "every accepted job to finish",
        lambda: all(s in ("succeeded", "failed", "cancelled")
                    for s in stack.statuses().values()), FINISH_TIMEOUT_S,
        describe=stack.unfinished)
    _check_each_accepted_job_succeeded_once(stack, accepted)
    assert stack.client.get("/readyz").status_code == 200
    times = {
        "ready_again_s": ready_again_s,
        "refused_s": last_refusal - injected_at if refused else 0.0,
        "accepting_again_s": next(a.sent_at for a in answers
                                  if a.status_code == 202 and a.sent_at >= last_refusal)
        - injected_at,
        "all_done_s": time.monotonic() - injected_at,
        "num_refused": float(len(refused)),
        "num_accepted": float(len(accepted)),
    }
    logger.warning("%s fault: %s (then %.1fs to finish the rest)", fault,
                   {k: round(v, 1) for k, v in times.items()}, finished_in)
    return times


def _check_each_accepted_job_succeeded_once(stack: Stack, accepted: list[str]) -> None:
    statuses = stack.statuses()
    # A 503 leaves nothing behind: the only rows are the accepted jobs.
    assert set(statuses) == set(accepted), "rows without a 202, or 202s without a row"
    assert set(statuses.values()) == {"succeeded"}, statuses
    with stack.db.connect() as connection:
        writes: dict[str, int] = dict(connection.execute(sa.text(
            "SELECT job_id, count(*) FROM result_writes GROUP BY job_id")).all())
        num_without_result = connection.execute(sa.text(
            "SELECT count(*) FROM jobs WHERE result IS NULL")).scalar_one()
    assert writes == dict.fromkeys(accepted, 1), "each result is written exactly once"
    assert num_without_result == 0


def _stop(stack: Stack, timeout: float = 90.0, *, is_broker_up: bool = True) -> float:
    """SIGTERM `up`: no job is accepted from then on, and a refusal says the service is
    stopping (unless the broker is down too); it must exit 0; the seconds it took."""
    started = time.monotonic()
    stack.up.process.send_signal(signal.SIGTERM)
    answers = []
    while stack.up.process.poll() is None and time.monotonic() - started < timeout:
        try:
            response = stack.client.post("/v1/jobs", json=_body("while-stopping"), timeout=5)
        except httpx.TransportError:
            break  # the API has stopped listening
        answers.append(response.status_code)
        if response.status_code == 503 and is_broker_up:  # stopping, not a dependency down
            assert response.json()["error"]["code"] == "service_stopping", response.text
        time.sleep(0.1)
    assert 202 not in answers, f"accepted a job while stopping: {answers}"
    assert stack.up.stop(timeout) == 0, stack.up.log_tail()
    return time.monotonic() - started


def _restarts(stack: Stack, service: str) -> float:
    text = stack.client.get("/metrics").text
    for line in text.splitlines():
        if line.startswith("batchinfer_embedded_service_restarts_total") and \
                f'service="{service}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


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
    times = _survive(stack, fault="broker", inject=lambda: stack.up.kill_child("tansu"),
                     expect_refusals=False, refused_within_s=PUBLISH_TIMEOUT_S + 2)
    assert _restarts(stack, "tansu") == 1
    log = stack.up.log_tail(200_000)
    assert "restarted tansu" in log and "broker restored" in log
    assert times["accepting_again_s"] < RECOVERY_TIMEOUT_S
    _stop(stack)


def test_redis_killed_mid_stream(tiny_up: Callable[..., Stack], postgres_url: str) -> None:
    """SIGKILL Redis: submissions go on (it is a cache), `up` restarts it, jobs finish."""
    stack = tiny_up(postgres_url)
    _survive(stack, fault="redis", inject=lambda: stack.up.kill_child("redis-server"),
             expect_refusals=False)
    assert _restarts(stack, "redis") == 1
    _stop(stack)


def test_worker_killed_mid_stream(tiny_up: Callable[..., Stack], postgres_url: str) -> None:
    """SIGKILL the inference worker: its supervisor starts another, which re-runs the
    jobs the dead one held."""
    stack = tiny_up(postgres_url)
    killed: list[int] = []
    _survive(stack, fault="worker",
             inject=lambda: killed.append(stack.up.kill_child("workers.inference")),
             expect_refusals=False)
    assert stack.up.child("workers.inference").pid not in killed
    _stop(stack)


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
        body = {**_body(f"frozen-{i}"), "max_tokens": FROZEN_JOB_TOKENS}
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
    _check_each_accepted_job_succeeded_once(stack, job_ids)
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
    _stop(stack)


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
    _survive(
        stack, fault="postgres",
        inject=lambda: own_postgres.pg_ctl("-m", "immediate", "stop"),
        restore=own_postgres.start_durable,
        expect_refusals=True)
    assert stack.up.child("workers.inference").pid == worker.pid, stack.up.log_tail(12000)
    _stop(stack)


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
    stopped_in = _stop(stack, is_broker_up=False)
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
