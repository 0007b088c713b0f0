"""Tenants sharing one worker: fair share under a big batch, and a token budget held.

Three scenarios on `batchinfer up` (embedded broker, Redis, SQLite) with one worker and the
tiny random-weight Llama (tests.unit.engine.tiny_models) or any model given:

  fairness  B's --num-b normal jobs alone (idle); A's --lines-line low-priority batch
            alone (solo); then A's batch again with B's jobs arriving --b-after s later
            (mixed). Reported: B's time mixed / idle (target <= 2x), and A's lines/s mixed
            against solo (target: a loss <= 10%, beyond B's own share of the worker).
            Then the same mixed run with A's batch and B's jobs at the same priority,
            which fair share alone has to handle (`--mix same` runs only that one,
            `--mix priority` only the first).
  sustained B keeps --b-inflight normal-sized jobs running, one submitted as soon as one
            ends, for the whole of A's --lines-line batch at the same priority (low).
            Reported: B's job latency (median/p90) beside A against B alone, and A's
            lines/s beside B; across --tenant-max-loss values, what the cap costs A.
  budget    tenant A limited to --tokens-per-minute runs a batch of about --work-tokens
            tokens; every job must complete, and no UTC minute of stored usage (prompt +
            completion by finished_at) may hold more than the budget plus one job.

    .venv/bin/python -m bench.tenant_fairness                         # shortened scale
    .venv/bin/python -m bench.tenant_fairness --lines 5000 --work-tokens 100000  # the issue's
    .venv/bin/python -m bench.tenant_fairness --scenario sustained fairness --mix same \
        --tenant-max-loss 0 0.1 --rounds 2   # cap off and on, alternated, one service each

With several --tenant-max-loss values each round starts one service per value, in an
order that alternates between rounds, so that the values see the same drift of load.

The issue's full scale is 5,000 lines and 100,000 tokens at 20,000 tokens/minute (five
minutes for the budget scenario alone); the defaults are shortened, and say so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from scheduler.embedded_services import free_port
from storage.db import create_db_engine, session_factory
from storage.models import Job
from tests.unit.engine.tiny_models import save_tiny_llama
from tests.utils.up_process import UpProcess, start_up

CHAT = "/v1/chat/completions"


@dataclass(slots=True)
class Service:
    """A running `up` and the keys of tenants A (dev) and B."""

    up: UpProcess
    data_dir: Path
    model: str
    a_key: str
    b_key: str

    def client(self, key: str) -> httpx.Client:
        """An HTTP client as the tenant holding `key`."""
        return httpx.Client(base_url=self.up.url, timeout=120,
                            headers={"Authorization": f"Bearer {key}"})

    def cli(self, *args: str) -> str:
        """Run `batchinfer --data-dir ... <args>`; its stdout."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
        done = subprocess.run([sys.executable, "-m", "cli", "--data-dir", str(self.data_dir),
                               *args], capture_output=True, text=True, env=env, check=True)
        return done.stdout

    def jobs(self, **where: Any) -> list[Job]:
        """Job rows matching `where` (column=value), from the service's SQLite file."""
        engine = create_db_engine(f"sqlite:///{self.data_dir / 'batchinfer.db'}")
        try:
            with session_factory(engine)() as session:
                query = select(Job)
                for name, value in where.items():
                    column = getattr(Job, name)
                    query = query.where(column.in_(value) if isinstance(value, list)
                                        else column == value)
                rows = list(session.scalars(query))
                session.expunge_all()
                return rows
        finally:
            engine.dispose()


def start(root: Path, model: str, extra_env: dict[str, str]) -> Service:
    """`batchinfer up` with one worker; tenant B created."""
    data_dir = root / "data"
    root.mkdir(parents=True, exist_ok=True)
    env = {"BATCHINFER_MODEL": model, **extra_env}
    up = start_up(data_dir, free_port(), num_workers=1, log_path=root / "up.log",
                  extra_env=env)
    service = Service(up, data_dir, model, up.api_key, "")
    service.b_key = service.cli("keys", "create", "--tenant", "b").strip().splitlines()[-1]
    return service


# Each run's prompts carry its number, not its name: distinct from every other run's (the
# result cache stays out of the way) and the same length in tokens, so that runs compare.
# Named runs differed by up to 5 tokens of a line's ~22 uncached ones on SmolLM2, and
# with prefill ~2/3 of the work that alone made A's mixed run ~15% slower than its solo.
RUN_NUMBERS = itertools.count(1)


def chat(model: str, content: str, max_tokens: int, priority: str | None = None
         ) -> dict[str, Any]:
    """A chat body; distinct contents keep the result cache out of the way."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True,
                            "messages": [{"role": "user", "content": content}]}
    if priority is not None:
        body["priority"] = priority
    return body


def run_b_jobs(service: Service, tag: str, args: argparse.Namespace, priority: str,
               ids: list[str] | None = None) -> float:
    """Submit B's jobs, wait for all; seconds from the first submission to the last end.
    Their ids go into `ids` when given; the stages of their way are printed."""
    run = next(RUN_NUMBERS)
    with service.client(service.b_key) as client:
        started = time.monotonic()
        ids = [] if ids is None else ids
        post_s: list[float] = []
        for i in range(args.num_b):
            posted = time.monotonic()
            response = client.post("/v1/jobs", json=chat(
                service.model, f"run {run:03d} tenant B question {i}", args.max_tokens,
                priority))
            response.raise_for_status()
            post_s.append(time.monotonic() - posted)
            ids.append(response.json()["id"])
        submitted_s = time.monotonic() - started
        for job_id in ids:
            while client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()["status"] in (
                    "queued", "running"):
                pass
        took = time.monotonic() - started
    print_timeline(service, tag, ids, post_s, submitted_s, took)
    return took


def _quantiles(values: list[float]) -> str:
    """"median/p90/max" in milliseconds."""
    ordered = sorted(values)
    if not ordered:
        return "-"
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{statistics.median(ordered) * 1000:.0f}/{p90 * 1000:.0f}/{ordered[-1] * 1000:.0f}"


def print_timeline(service: Service, tag: str, ids: list[str], post_s: list[float],
                   submitted_s: float, took: float) -> None:
    """Where B's jobs spent their time (median/p90/max ms per stage, from the job rows):
    the client's POST, accepted -> claimed by the worker, claimed -> first token, first
    token -> finished; and the span of all of them."""
    rows = service.jobs(id=ids)
    waits = [(j.started_at - j.created_at).total_seconds() for j in rows if j.started_at]
    firsts = [(j.first_token_at - j.started_at).total_seconds() for j in rows
              if j.first_token_at and j.started_at]
    decodes = [(j.finished_at - j.first_token_at).total_seconds() for j in rows
               if j.finished_at and j.first_token_at]
    first = min(j.created_at for j in rows)
    last = max(j.finished_at or j.created_at for j in rows)
    print(f"  B timeline [{tag}] ms median/p90/max: POST {_quantiles(post_s)}; accepted->claimed "
          f"{_quantiles(waits)}; claimed->first token {_quantiles(firsts)}; first token->"
          f"finished {_quantiles(decodes)}; all POSTs answered after {submitted_s:.2f} s, "
          f"first accepted to last finished {(last - first).total_seconds():.2f} s, "
          f"client saw all done after {took:.2f} s")


def start_batch(service: Service, tag: str, num_lines: int, max_tokens: int,
                priority: str) -> str:
    """Upload A's batch file and create the batch; its id."""
    run = next(RUN_NUMBERS)
    lines = [json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": CHAT,
                         "body": chat(service.model, f"run {run:03d} tenant A line {i}",
                                      max_tokens)})
             for i in range(num_lines)]
    with service.client(service.a_key) as client:
        uploaded = client.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("a.jsonl", "\n".join(lines).encode())})
        uploaded.raise_for_status()
        batch = client.post("/v1/batches", json={
            "input_file_id": uploaded.json()["id"], "endpoint": CHAT,
            "completion_window": "24h", "priority": priority})
        batch.raise_for_status()
        return str(batch.json()["id"])


def wait_batch(service: Service, batch_id: str, timeout: float) -> dict[str, Any]:
    """Poll the batch until it ends."""
    deadline = time.monotonic() + timeout
    with service.client(service.a_key) as client:
        while time.monotonic() < deadline:
            batch = client.get(f"/v1/batches/{batch_id}").json()
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                return dict(batch)
            time.sleep(0.5)
    raise TimeoutError(f"batch {batch_id} still running after {timeout} s")


def batch_rate(service: Service, batch_id: str) -> tuple[float, float]:
    """(lines per second from the first start to the last end, that span in seconds)."""
    rows = service.jobs(batch_id=batch_id)
    first = min(j.started_at or j.created_at for j in rows)
    last = max(j.finished_at or j.created_at for j in rows)
    span = (last - first).total_seconds()
    return len(rows) / span, span


def print_pace(service: Service, tag: str, batch_id: str, window_s: float = 5.0) -> None:
    """A's lines finished per window from the batch's first start: where a loss sits."""
    rows = service.jobs(batch_id=batch_id)
    first = min(j.started_at or j.created_at for j in rows)
    counts: dict[int, int] = {}
    for job in rows:
        if job.finished_at is not None:
            window = int((job.finished_at - first).total_seconds() // window_s)
            counts[window] = counts.get(window, 0) + 1
    pace = " ".join(str(counts.get(w, 0)) for w in range(max(counts, default=-1) + 1))
    print(f"  A's lines finished per {window_s:.0f} s [{tag}]: {pace}")


def fairness(service: Service, args: argparse.Namespace) -> str:
    """Idle B, solo A, then mixed (B low-vs-normal, then same priority)."""
    run_b_jobs(service, "warm-up", argparse.Namespace(num_b=4, max_tokens=4), "normal")
    idle_s = run_b_jobs(service, "idle", args, "normal")
    solo = start_batch(service, "solo", args.lines, args.max_tokens, "low")
    wait_batch(service, solo, args.timeout)
    solo_rate, solo_span = batch_rate(service, solo)
    print_pace(service, "solo", solo)
    print(f"idle: B's {args.num_b} jobs in {idle_s:.2f} s; "
          f"solo: A's {args.lines} lines at {solo_rate:.1f} lines/s ({solo_span:.1f} s)")
    mixes = (("A low, B normal", "low", "normal"), ("A and B low", "low", "low"))
    for name, a_priority, b_priority in mixes:
        if args.mix != "both" and (args.mix == "same") != (a_priority == b_priority):
            continue
        tag = name.replace(" ", "-").replace(",", "")
        batch_id = start_batch(service, tag, args.lines, args.max_tokens, a_priority)
        time.sleep(args.b_after)
        b_ids: list[str] = []
        b_s = run_b_jobs(service, tag, args, b_priority, b_ids)
        wait_batch(service, batch_id, args.timeout)
        rate, span = batch_rate(service, batch_id)
        print_pace(service, tag, batch_id)
        b_jobs = service.jobs(id=b_ids)
        submitted = min(j.created_at for j in b_jobs)
        last_b_start = max(j.started_at or j.created_at for j in b_jobs)
        a_jobs = service.jobs(batch_id=batch_id)
        num_between = sum(1 for j in a_jobs if j.started_at is not None
                          and submitted < j.started_at < last_b_start)
        num_queued_then = sum(1 for j in a_jobs if j.created_at < submitted
                              and (j.started_at is None or j.started_at > submitted))
        print(f"  {num_between} of A's lines started between B's first submission and B's "
              f"last start; {num_queued_then} of A's were queued when B submitted")
        b_share = args.num_b / (args.lines + args.num_b)
        line = (f"mixed ({name}): B's jobs in {b_s:.2f} s = {b_s / idle_s:.2f}x idle; "
                f"A at {rate:.1f} lines/s over {span:.1f} s = {1 - rate / solo_rate:.1%} below "
                f"solo (B's own share of the work {b_share:.1%}); load {os.getloadavg()[0]:.1f}")
        print(line)
    if args.control:
        # A alone again: how far A's pace drifts between two runs of one service, which
        # the mixed run's loss must be read against.
        again = start_batch(service, "solo-again", args.lines, args.max_tokens, "low")
        wait_batch(service, again, args.timeout)
        again_rate, again_span = batch_rate(service, again)
        print_pace(service, "solo again", again)
        line += (f"; A alone again at {again_rate:.1f} lines/s over {again_span:.1f} s = "
                 f"{1 - again_rate / solo_rate:.1%} below the first solo run")
        print(line)
    return line


def keep_b_running(service: Service, args: argparse.Namespace, tag: str,
                   stop: threading.Event, ids: list[str]) -> list[threading.Thread]:
    """--b-inflight threads, each submitting B's next low job as soon as its last one ends,
    until `stop`; every job's id goes into `ids`."""
    run = next(RUN_NUMBERS)

    def loop(slot: int) -> None:
        with service.client(service.b_key) as client:
            i = 0
            while not stop.is_set():
                response = client.post("/v1/jobs", json=chat(
                    service.model, f"run {run:03d} tenant B slot {slot} question {i}",
                    args.max_tokens, "low"))
                response.raise_for_status()
                job_id = response.json()["id"]
                ids.append(job_id)
                while client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()[
                        "status"] in ("queued", "running"):
                    pass
                i += 1
    threads = [threading.Thread(target=loop, args=(slot,), daemon=True)
               for slot in range(args.b_inflight)]
    for thread in threads:
        thread.start()
    return threads


def b_latencies(service: Service, ids: list[str]) -> list[float]:
    """Seconds from acceptance to the end of each of these finished jobs."""
    return [(j.finished_at - j.created_at).total_seconds() for j in service.jobs(id=ids)
            if j.finished_at is not None]


def sustained(service: Service, args: argparse.Namespace) -> str:
    """B alone with --b-inflight jobs running, then beside A's batch for the whole of it."""
    run_b_jobs(service, "warm-up", argparse.Namespace(num_b=4, max_tokens=4), "normal")
    stop = threading.Event()
    idle_ids: list[str] = []
    threads = keep_b_running(service, args, "sustained-idle", stop, idle_ids)
    time.sleep(args.b_idle_s)
    stop.set()
    for thread in threads:
        thread.join()
    idle = b_latencies(service, idle_ids)
    batch_id = start_batch(service, "sustained", args.lines, args.max_tokens, "low")
    stop = threading.Event()
    mixed_ids: list[str] = []
    threads = keep_b_running(service, args, "sustained-mixed", stop, mixed_ids)
    wait_batch(service, batch_id, args.timeout)
    stop.set()
    for thread in threads:
        thread.join()
    rate, span = batch_rate(service, batch_id)
    a_rows = service.jobs(batch_id=batch_id)
    a_end = max(j.finished_at for j in a_rows if j.finished_at is not None)
    # B's jobs that ran wholly beside A's batch (the last few may end after it).
    mixed = [(j.finished_at - j.created_at).total_seconds() for j in service.jobs(id=mixed_ids)
             if j.finished_at is not None and j.finished_at <= a_end]
    line = (f"sustained (A and B low, B {args.b_inflight} in flight): B alone {len(idle)} jobs "
            f"median/p90 {_quantiles(idle)} ms; beside A {len(mixed)} jobs {_quantiles(mixed)}"
            f" ms = {statistics.median(mixed) / statistics.median(idle):.2f}x idle (median); "
            f"A at {rate:.1f} lines/s over {span:.1f} s; load {os.getloadavg()[0]:.1f}")
    print(line)
    return line


def budget(service: Service, args: argparse.Namespace) -> str:
    """A batch of about --work-tokens tokens under --tokens-per-minute."""
    service.cli("tenants", "set-limits", "--tenant", "dev",
                "--tokens-per-minute", str(args.tokens_per_minute))
    time.sleep(6)  # API processes re-read limits within tenant_limits_refresh_s (5 s)
    probe = start_batch(service, "probe", 4, args.budget_max_tokens, "normal")
    wait_batch(service, probe, args.timeout)
    per_job = [(j.prompt_tokens or 0) + (j.completion_tokens or 0)
               for j in service.jobs(batch_id=probe)]
    tokens_per_job = sum(per_job) / len(per_job)
    num_lines = max(1, round(args.work_tokens / tokens_per_job))
    started = time.monotonic()
    batch_id = start_batch(service, "budget", num_lines, args.budget_max_tokens, "normal")
    batch = wait_batch(service, batch_id, args.timeout + 4 * args.work_tokens
                       / args.tokens_per_minute * 60)
    took = time.monotonic() - started
    rows = service.jobs(batch_id=batch_id)
    by_minute: dict[str, int] = defaultdict(int)
    for job in rows:
        if job.finished_at is not None:
            by_minute[job.finished_at.strftime("%H:%M")] += (job.prompt_tokens or 0) + (
                job.completion_tokens or 0)
    total = sum(by_minute.values())
    print(f"budget: {len(rows)} jobs of ~{tokens_per_job:.0f} tokens ({total:,} in all) "
          f"under {args.tokens_per_minute:,}/min: status {batch['status']}, counts "
          f"{batch['request_counts']}, {took:.0f} s")
    for minute, tokens in sorted(by_minute.items()):
        over = tokens - args.tokens_per_minute
        print(f"  {minute} UTC: {tokens:,} tokens"
              + (f" (over by {over:,}, {over / tokens_per_job:.1f} jobs)" if over > 0 else ""))
    usage = batch.get("usage") or {}
    print(f"  batch usage {usage.get('total_tokens')} vs stored jobs {total:,}: "
          f"{'equal' if usage.get('total_tokens') == total else 'DIFFER'}")
    return f"budget: {took:.0f} s"


SCENARIOS = {"fairness": fairness, "sustained": sustained, "budget": budget}


def main() -> None:
    """Run the scenarios asked for and print their figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default="tiny", help="`tiny` (random-weight Llama) or a model name/dir")
    add("--scenario", nargs="+", choices=[*SCENARIOS, "both"], default=["both"],
        help="`both`: fairness and budget")
    add("--lines", type=int, default=1000, help="A's batch lines (the issue: 5,000)")
    add("--num-b", type=int, default=50, help="B's jobs")
    add("--b-after", type=float, default=3.0, help="seconds between A's batch and B's jobs")
    add("--b-inflight", type=int, default=8, help="B's jobs kept running (sustained)")
    add("--b-idle-s", type=float, default=10.0, help="seconds B runs alone (sustained)")
    add("--max-tokens", type=int, default=8, help="output tokens per job (fairness)")
    add("--tokens-per-minute", type=int, default=20_000)
    add("--work-tokens", type=int, default=50_000, help="the issue: 100,000")
    add("--budget-max-tokens", type=int, default=64, help="output tokens per budget job")
    add("--mix", choices=["both", "priority", "same"], default="both",
        help="mixed runs: A low with B normal (priority), both low (same), or both")
    add("--timeout", type=float, default=1800.0)
    add("--control", action="store_true",
        help="after the mixed runs, run A alone again (the drift between two solo runs)")
    add("--tenant-max-loss", nargs="+", default=[None],
        help="BATCHINFER_ENGINE_TENANT_MAX_LOSS values, one service each (default: its own)")
    add("--rounds", type=int, default=1, help="rounds over the --tenant-max-loss values")
    add("--window", type=int, default=None,
        help="BATCHINFER_BATCH_MAX_QUEUED_LINES for the service (default: its own, 2000)")
    add("--set", action="append", default=[], metavar="BATCHINFER_NAME=VALUE",
        help="a setting for the service (repeatable)")
    args = parser.parse_args()
    scenarios = [s for s in SCENARIOS if s in args.scenario
                 or ("both" in args.scenario and s in ("fairness", "budget"))]
    print(f"load {os.getloadavg()[0]:.1f}, model {args.model}, {args.lines} lines, "
          f"tenant max loss {args.tenant_max_loss}, {args.num_b} B jobs, {args.b_inflight} "
          f"B in flight, {args.work_tokens:,} tokens at {args.tokens_per_minute:,}/min")
    summary: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model
        if model == "tiny":
            model = str(root / "tiny")
            save_tiny_llama(Path(model))
        for round_no in range(args.rounds):
            values = args.tenant_max_loss if round_no % 2 == 0 else args.tenant_max_loss[::-1]
            for value in values:
                for scenario in scenarios:
                    env = {"BATCHINFER_LOG_LEVEL": "WARNING"}
                    for setting in args.set:
                        name, _, setting_value = setting.partition("=")
                        env[name] = setting_value
                    if args.window is not None:
                        env["BATCHINFER_BATCH_MAX_QUEUED_LINES"] = str(args.window)
                    if value is not None:
                        env["BATCHINFER_ENGINE_TENANT_MAX_LOSS"] = value
                    print(f"--- round {round_no + 1}, tenant max loss {value}, {scenario}, "
                          f"{time.strftime('%H:%M:%S', time.gmtime())} UTC, load "
                          f"{os.getloadavg()[0]:.1f}", flush=True)
                    name = f"{scenario}-{round_no}-{value}"
                    service = start(root / name, model, env)
                    try:
                        line = SCENARIOS[scenario](service, args)
                        summary.append(f"round {round_no + 1}, max loss {value}: {line}")
                    finally:
                        service.up.stop(timeout=120.0)
    print("summary:")
    for line in summary:
        print(f"  {line}")


if __name__ == "__main__":
    main()
