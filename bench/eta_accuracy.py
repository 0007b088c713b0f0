"""How close the service's finish-time estimates come to the real finish, and deadline order.

One `batchinfer up` (embedded broker, Redis, SQLite) with one worker, on the tiny
random-weight Llama (tests.unit.engine.tiny_models) or any model given. Phases:

  batch      a --lines batch alone: its `estimated_completion_at` read when 10%, 25% and
             50% of its lines are done, against the moment it completed. The error is
             (estimated - actual) / actual time left from the reading (target +/-20%).
  jobs       single jobs submitted while a --backlog-line batch runs (half of them with
             --max-tokens, half with 4x as many): each job's `estimated_completion_at`
             read right after its submission, against its `finished_at` (target +/-25%).
  deadlines  a busy service (a --backlog-line batch without a deadline of its own that
             matters) takes three --deadline-lines batches with completion windows 24h, 2h
             and 30m, submitted in that (reverse) order; they must finish 30m, 2h, 24h. Then
             a batch whose 1m window the backlog cannot meet must be refused with the
             estimate (409 deadline_unattainable).

Prompts are distinct (no cache answers), greedy, EOS ignored: every job runs to its
max_tokens.

    .venv/bin/python -m bench.eta_accuracy                                  # tiny model
    .venv/bin/python -m bench.eta_accuracy --model smollm2-135m-instruct --lines 300
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from bench.tenant_fairness import CHAT, Service, chat, wait_batch
from scheduler.embedded_services import free_port
from storage.db import create_db_engine
from storage.models import Job, JobStatus, WorkerHeartbeat
from tests.unit.engine.tiny_models import save_tiny_llama
from tests.utils.up_process import start_up

CHECKPOINTS = (0.10, 0.25, 0.50)


@dataclass(slots=True)
class Reading:
    """One look at a batch: when, how many lines were done, and its estimate then."""

    at: float
    num_done: int
    estimated_completion_at: float | None
    # The worker's reported pace then (tokens/s), and the batch's running lines.
    tokens_per_s: float | None = None
    num_running: int | None = None


def start(root: Path, model: str) -> Service:
    """`batchinfer up` with one worker."""
    data_dir = root / "data"
    root.mkdir(parents=True, exist_ok=True)
    up = start_up(data_dir, free_port(), num_workers=1, log_path=root / "up.log",
                  extra_env={"BATCHINFER_MODEL": model, "BATCHINFER_LOG_LEVEL": "WARNING"})
    return Service(up, data_dir, model, up.api_key, "")


def upload_batch(client: httpx.Client, model: str, tag: str, num_lines: int,
                 max_tokens: int) -> str:
    """Upload a batch file of distinct chat lines; its file id."""
    lines = [json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": CHAT,
                         "body": chat(model, f"{tag} line {i}: say something", max_tokens)})
             for i in range(num_lines)]
    response = client.post("/v1/files", data={"purpose": "batch"},
                           files={"file": (f"{tag}.jsonl", "\n".join(lines).encode())})
    response.raise_for_status()
    return str(response.json()["id"])


def create_batch(client: httpx.Client, file_id: str, window: str,
                 priority: str = "normal", **extra: Any) -> httpx.Response:
    """POST /v1/batches (the response as it came)."""
    return client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT,
                                            "completion_window": window, "priority": priority,
                                            **extra})


def follow(client: httpx.Client, service: Service, batch_id: str, timeout: float,
           interval_s: float = 0.25) -> tuple[list[Reading], float]:
    """Read the batch until it ends: the readings, and when it was first seen ended. Lines
    done are counted from the job rows: the batch's own counts move at its passes (up to
    `batch_poll_interval_s` apart), and a batch of the tiny model can end between two."""
    readings: list[Reading] = []
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        now = time.time()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return readings, now
        num_done, tokens_per_s, num_running = load_now(service, batch_id)
        readings.append(Reading(now, num_done, batch.get("estimated_completion_at"),
                                tokens_per_s, num_running))
        time.sleep(interval_s)
    raise TimeoutError(f"batch {batch_id} still running after {timeout} s")


def load_now(service: Service, batch_id: str) -> tuple[int, float | None, int]:
    """The batch's finished lines, the worker's reported tokens/s (summed) and the batch's
    running lines, now."""
    engine = create_db_engine(f"sqlite:///{service.data_dir / 'batchinfer.db'}")
    try:
        with engine.connect() as connection:
            rates = connection.execute(select(WorkerHeartbeat.tokens_per_s)).scalars().all()
            counts = dict(connection.execute(
                select(Job.status, func.count()).where(Job.batch_id == batch_id)
                .group_by(Job.status)).all())
    finally:
        engine.dispose()
    num_done = sum(n for status, n in counts.items() if JobStatus(status).is_terminal)
    return num_done, (sum(r for r in rates if r) or None), counts.get(JobStatus.RUNNING, 0)


def print_trace(readings: list[Reading], ended_at: float, every_s: float = 2.0) -> None:
    """Predicted against actual time left through the run, one reading every `every_s`."""
    print("  trace: t(s)  done  running  reported tokens/s  ETA ahead(s)  left(s)  error")
    start = readings[0].at
    next_at = start
    for r in readings:
        if r.at < next_at or r.estimated_completion_at is None:
            continue
        next_at = r.at + every_s
        print(f"  {r.at - start:6.1f} {r.num_done:5d} {r.num_running or 0:8d} "
              f"{r.tokens_per_s or 0:18.0f} {r.estimated_completion_at - r.at:13.1f} "
              f"{ended_at - r.at:8.1f} {error(r.estimated_completion_at, ended_at, r.at):+6.0%}")


def pace(service: Service) -> str:
    """The pace the live workers' heartbeats carry now."""
    engine = create_db_engine(f"sqlite:///{service.data_dir / 'batchinfer.db'}")
    try:
        with engine.connect() as connection:
            rows = connection.execute(select(WorkerHeartbeat.tokens_per_s,
                                             WorkerHeartbeat.step_s)).all()
    finally:
        engine.dispose()
    return ", ".join(f"{t or 0:.0f} tokens/s, {(s or 0) * 1e3:.1f} ms/step" for t, s in rows)


def error(estimated_at: float, actual_at: float, since: float) -> float:
    """Signed error of an estimate, relative to the time that was actually left."""
    return (estimated_at - actual_at) / max(actual_at - since, 1e-9)


def batch_phase(service: Service, args: argparse.Namespace) -> None:
    """A batch alone: its ETA at 10%, 25% and 50% done against its real end."""
    with service.client(service.a_key) as client:
        file_id = upload_batch(client, service.model, "eta", args.lines, args.max_tokens)
        created = create_batch(client, file_id, "24h")
        created.raise_for_status()
        batch_id = created.json()["id"]
        readings, ended_at = follow(client, service, batch_id, args.timeout)
    rows = service.jobs(batch_id=batch_id)
    last_job_at = max(j.finished_at.timestamp() for j in rows if j.finished_at is not None)
    first_start = min(j.started_at.timestamp() for j in rows if j.started_at is not None)
    tokens = sum((j.prompt_tokens or 0) - (j.cached_tokens or 0) + (j.completion_tokens or 0)
                 for j in rows)
    print(f"pace: {tokens / (last_job_at - first_start):.0f} tokens/s from the first start to "
          f"the last finish; the worker reported {pace(service)}")
    print(f"batch: {args.lines} lines x {args.max_tokens} tokens; last line finished "
          f"{last_job_at - readings[0].at:.1f} s after the first reading, batch seen "
          f"completed {ended_at - last_job_at:.1f} s later; load {os.getloadavg()[0]:.1f}")
    for fraction in CHECKPOINTS:
        reading = next((r for r in readings if r.num_done >= fraction * args.lines), None)
        if reading is None or reading.estimated_completion_at is None:
            print(f"  at {fraction:.0%}: no estimate")
            continue
        left = ended_at - reading.at
        shown = reading.estimated_completion_at - reading.at
        print(f"  at {fraction:.0%} ({reading.num_done} done): ETA {shown:.1f} s ahead, "
              f"completed {left:.1f} s later: error "
              f"{error(reading.estimated_completion_at, ended_at, reading.at):+.0%}")
    if args.trace:
        print_trace(readings, ended_at)


def jobs_phase(service: Service, args: argparse.Namespace) -> None:
    """Single jobs behind a running batch: ETA at submission against their finish."""
    probes: list[tuple[str, int, float, float | None, float | None]] = []
    # What the estimate at each submission rested on: its queue position, the worker's
    # reported pace and the batch's lines queued then.
    seen: dict[str, str] = {}
    with service.client(service.a_key) as client:
        file_id = upload_batch(client, service.model, "backlog", args.backlog, args.max_tokens)
        created = create_batch(client, file_id, "24h")
        created.raise_for_status()
        batch_id = created.json()["id"]
        time.sleep(args.probe_every)
        for i in range(args.num_probes):
            max_tokens = args.max_tokens * (1 if i % 2 == 0 else 4)
            submitted = time.time()
            job = client.post("/v1/jobs", json=chat(service.model, f"probe {i}", max_tokens,
                                                    "normal"))
            job.raise_for_status()
            job_id = job.json()["id"]
            view = client.get(f"/v1/jobs/{job_id}").json()
            num_queued = len(service.jobs(batch_id=batch_id, status=JobStatus.QUEUED))
            seen[job_id] = (f"position {view.get('queue_position')}, {num_queued} lines "
                            f"queued, pace {pace(service)}")
            probes.append((job_id, max_tokens, submitted, view.get("estimated_completion_at"),
                           view.get("estimated_start_at")))
            time.sleep(args.probe_every)
        wait_batch(service, batch_id, args.timeout)
        for job_id, *_ in probes:
            while client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()[
                    "status"] in ("queued", "running"):
                pass
    # The stored time, not the API's whole seconds: a job may take only a few seconds.
    rows = service.jobs(id=[p[0] for p in probes])
    ends = {j.id: j.finished_at.timestamp() for j in rows if j.finished_at is not None}
    starts = {j.id: j.started_at.timestamp() for j in rows if j.started_at is not None}
    backlog_end = max(j.finished_at.timestamp() for j in service.jobs(batch_id=batch_id)
                      if j.finished_at is not None)
    print(f"jobs: {args.num_probes} jobs behind a {args.backlog}-line batch, one every "
          f"{args.probe_every:.1f} s; load {os.getloadavg()[0]:.1f}")
    errors: dict[int, list[float]] = {}
    for job_id, max_tokens, submitted, estimated, estimated_start in probes:
        finished = ends[job_id]
        if submitted >= backlog_end:
            print(f"  {max_tokens:>3} tokens: submitted after the backlog ended (not counted)")
            continue
        if estimated is None:
            print(f"  {max_tokens:>3} tokens: no estimate (took {finished - submitted:.1f} s)")
            continue
        e = error(estimated, finished, submitted)
        errors.setdefault(max_tokens, []).append(e)
        # Where the error lies: the wait for a place (start) or the job's own run.
        started = starts.get(job_id, finished)
        start_at = submitted if estimated_start is None else max(estimated_start, submitted)
        print(f"  {max_tokens:>3} tokens: ETA {estimated - submitted:.1f} s, took "
              f"{finished - submitted:.1f} s (start {start_at - submitted:.1f} s estimated, "
              f"{started - submitted:.1f} s actual; own run {estimated - start_at:.1f} s "
              f"estimated, {finished - started:.1f} s actual), backlog done "
              f"{backlog_end - submitted:.1f} s after submission: error {e:+.0%}\n"
              f"      at submission: {seen[job_id]}")
    for max_tokens, values in sorted(errors.items()):
        worst = max(values, key=abs)
        print(f"  {max_tokens} tokens: worst error {worst:+.0%}, mean "
              f"{sum(values) / len(values):+.0%} over {len(values)}")


def deadlines_phase(service: Service, args: argparse.Namespace) -> None:
    """Windows 24h, 2h and 30m submitted in that order behind a backlog: finish order."""
    with service.client(service.a_key) as client:
        backlog_file = upload_batch(client, service.model, "busy", args.backlog, args.max_tokens)
        files = {w: upload_batch(client, service.model, f"w{w}", args.deadline_lines,
                                 args.max_tokens) for w in ("24h", "2h", "30m")}
        late_file = upload_batch(client, service.model, "late", args.late_lines,
                                 args.max_tokens)
        backlog = create_batch(client, backlog_file, "7d")
        backlog.raise_for_status()
        time.sleep(2.0)  # the backlog's lines are in the queue before the others arrive
        ids = {}
        for window in ("24h", "2h", "30m"):
            response = create_batch(client, files[window], window)
            response.raise_for_status()
            ids[window] = response.json()["id"]
        # A window the backlog cannot meet: one minute for many lines.
        asked = time.time()
        refused = create_batch(client, late_file, "1m")
        if refused.status_code == 200:  # out of the way of the others
            client.post(f"/v1/batches/{refused.json()['id']}/cancel")
    completed = {w: wait_batch(service, ids[w], args.timeout)["completed_at"] for w in ids}
    wait_batch(service, backlog.json()["id"], args.timeout)
    # The work's end (the last line's finish), not the batch loop's later pass.
    ends = {w: max(j.finished_at.timestamp() for j in service.jobs(batch_id=ids[w])
                   if j.finished_at is not None) for w in ids}
    backlog_end = max(j.finished_at.timestamp() for j in service.jobs(
        batch_id=backlog.json()["id"]) if j.finished_at is not None)
    order = sorted(ends, key=lambda w: ends[w])
    print(f"deadlines: {args.deadline_lines}-line batches behind a {args.backlog}-line one, "
          f"submitted 24h, 2h, 30m; last lines finished {', '.join(order)} "
          f"({'deadline order' if order == ['30m', '2h', '24h'] else 'NOT deadline order'}); "
          f"load {os.getloadavg()[0]:.1f}")
    first = min(ends.values())
    print("  last line at " + ", ".join(f"{ends[w] - first:+.1f} s ({w})" for w in order)
          + f", the backlog's at {backlog_end - first:+.1f} s; batches completed at "
          + ", ".join(f"{completed[w] - first:+.0f} s ({w})" for w in order))
    body = refused.json()
    if refused.status_code == 409:
        estimate = body["error"].get("estimated_completion_at")
        print(f"  1m window for {args.late_lines} lines: 409 {body['error']['code']}, "
              f"estimate {estimate - asked:.0f} s from the request")
    else:
        print(f"  1m window for {args.late_lines} lines: NOT refused ({refused.status_code})")


def main() -> None:
    """Run the phases asked for and print their figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default="tiny", help="`tiny` (random-weight Llama) or a model name/dir")
    add("--phase", choices=["batch", "jobs", "deadlines", "all"], default="all")
    add("--lines", type=int, default=1000, help="lines of the batch phase")
    add("--max-tokens", type=int, default=64, help="output tokens per line")
    add("--backlog", type=int, default=3000,
        help="lines ahead of the jobs and the deadline batches (the jobs must be submitted "
             "while it runs)")
    add("--num-probes", type=int, default=8, help="single jobs of the jobs phase")
    add("--probe-every", type=float, default=2.0, help="seconds between those jobs")
    add("--deadline-lines", type=int, default=400,
        help="lines of each deadline batch (more than the engine runs at once, or they "
             "finish in one step)")
    add("--late-lines", type=int, default=60000,
        help="lines of the batch whose 1m window must be refused (8,000 tiny-model lines "
             "ran within the minute on a 2-core Zen 4, and were rightly accepted)")
    add("--timeout", type=float, default=1800.0)
    add("--trace", action="store_true",
        help="batch phase: print the estimate against the real finish every 2 s of the run")
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}, model {args.model}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model
        if model == "tiny":
            model = str(root / "tiny")
            save_tiny_llama(Path(model))
        service = start(root / "service", model)
        try:
            with service.client(service.a_key) as client:  # warm: the worker measures a pace
                upload = upload_batch(client, service.model, "warm", 40, args.max_tokens)
                warm = create_batch(client, upload, "24h")
                warm.raise_for_status()
            wait_batch(service, warm.json()["id"], args.timeout)
            for name, phase in (("batch", batch_phase), ("jobs", jobs_phase),
                                ("deadlines", deadlines_phase)):
                if args.phase in (name, "all"):
                    phase(service, args)
        finally:
            service.up.stop(timeout=120.0)


if __name__ == "__main__":
    main()
