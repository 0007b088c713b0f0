"""The fault tests' harness: `batchinfer up` on a PostgreSQL database, a client that keeps
submitting while a part is killed, and the checks every fault must pass (see
tests/integration/test_faults.py for what each promises)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import sqlalchemy as sa

from api.resources import PUBLISH_TIMEOUT_S
from tests.utils.up_process import UpProcess

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
            response = self.client.post("/v1/jobs", json=job_body(tag), timeout=SUBMIT_TIMEOUT_S)
        except httpx.TransportError:
            # No answer at all: recorded as status 0, which the checks refuse.
            self.answers.append(Answer(0, sent_at, time.monotonic() - sent_at, None, None))
            return
        job_id = response.json()["id"] if response.status_code == 202 else None
        self.answers.append(Answer(response.status_code, sent_at, time.monotonic() - sent_at,
                                   job_id, response.headers.get("retry-after")))


def job_body(tag: str) -> dict[str, Any]:
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
            response = self.client.post("/v1/jobs", json=job_body(f"{tag}-{i}"))
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


def count_result_writes(db: sa.Engine) -> None:
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


def survive(stack: Stack, *, fault: str, inject: Callable[[], object],
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
    check_each_accepted_job_succeeded_once(stack, accepted)
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


def check_each_accepted_job_succeeded_once(stack: Stack, accepted: list[str]) -> None:
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


def stop_up(stack: Stack, timeout: float = 90.0, *, is_broker_up: bool = True) -> float:
    """SIGTERM `up`: no job is accepted from then on, and a refusal says the service is
    stopping (unless the broker is down too); it must exit 0; the seconds it took."""
    started = time.monotonic()
    stack.up.process.send_signal(signal.SIGTERM)
    answers = []
    while stack.up.process.poll() is None and time.monotonic() - started < timeout:
        try:
            response = stack.client.post("/v1/jobs", json=job_body("while-stopping"), timeout=5)
        except httpx.TransportError:
            break  # the API has stopped listening
        answers.append(response.status_code)
        if response.status_code == 503 and is_broker_up:  # stopping, not a dependency down
            assert response.json()["error"]["code"] == "service_stopping", response.text
        time.sleep(0.1)
    assert 202 not in answers, f"accepted a job while stopping: {answers}"
    assert stack.up.stop(timeout) == 0, stack.up.log_tail()
    return time.monotonic() - started


def restarts_of(stack: Stack, service: str) -> float:
    text = stack.client.get("/metrics").text
    for line in text.splitlines():
        if line.startswith("batchinfer_embedded_service_restarts_total") and \
                f'service="{service}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
