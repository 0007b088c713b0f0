"""What the service costs around a nearly free engine: jobs/s end to end, API rate, batch path.

The engine is a tiny random-weight Llama and every job asks for 1 token, so almost all
the time measured is the service's own (HTTP, validation, database, Kafka, Redis, the
worker's loop), the way a GPU engine finishing thousands of short jobs a second would
see it. Phases, one at a time (they share the 2 cores):

  engine   `LLM.generate` on the same prompts: the ceiling the service is compared with
  api      `batchinfer up --workers 0`; wrk (C, 2 threads, 32 connections, distinct
           bodies from a Lua script) POSTs /v1/jobs for a fixed time: accepted/s, p50/p99
  e2e      `batchinfer up --workers 1`; wrk keeps 32 jobs in flight for a fixed time,
           each POSTed then long-polled (`?wait=`) until it succeeded: jobs/s
  burst    `batchinfer up --workers 1`; wrk POSTs --burst-jobs jobs at once (32
           connections, no waiting on results: open loop), then the service drains them:
           the rate they went in, and jobs/s from the first accepted to the last finished
           (from the jobs' own stored times), which a GPU worker meets first
  e2e-python  the same with two Python client processes (httpx) and a fixed job count,
           which read every result back in full; they cost as much CPU as the API, on
           the same cores, so `e2e` is the figure for the service
  batch    a JSONL batch of 1-token requests uploaded, run and its output downloaded:
           seconds, and the API process's memory before and after
  idle     `batchinfer up --workers 1` with nothing to do: the CPU each process burns
           a second (what a quiet deployment costs, and what a busy one pays beside
           its engine for polling and timers)

Each phase prints the CPU seconds per job of every process (API + scheduler, worker,
broker, Redis, the load generator), so the next bottleneck is visible. The tenant's rate
limit is lifted for the run (BATCHINFER_TENANT_RATE_LIMIT_PER_S), and said so.

    .venv/bin/python -m bench.service_overhead [--api-seconds 10 --e2e-seconds 20 \
        --batch-lines 50000 --phases engine api e2e batch idle]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from datetime import datetime
from pathlib import Path

import httpx
import psutil

from bench.engine_throughput import machine
from bench.role_cpu import cpu_seconds_by_pid, cpu_seconds_by_role
from bench.service_throughput import stop_service
from bench.short_jobs import engine_jobs_per_second, job_body
from scheduler.embedded_services import free_port
from tests.unit.engine.tiny_models import save_tiny_llama
from tests.utils.up_process import UpProcess, start_up

# Connections wrk keeps busy (--in-flight): what the targets are stated at.
IN_FLIGHT = 32
CLIENT_PROCESSES = 2
# Lua shared by both wrk phases: each thread numbers its own bodies (`tid`, set by setup in
# the thread's own Lua state), so no two submissions carry the same prompt and no job can be
# answered from the result cache.
WRK_COMMON = """
local threads = {}
function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end
function job_request()
  submitted = submitted + 1
  local body = string.format(
    '{"model": %q, "prompt": "%s %d %d 4 8 15 16 23 42 7 9 11 13", "max_tokens": 1, '
    .. '"temperature": 0}', os.getenv("BI_MODEL"), os.getenv("BI_TAG"), tid, submitted)
  return wrk.format("POST", "/v1/jobs", {["Content-Type"] = "application/json",
                                         ["Authorization"] = auth}, body)
end
function init(args)
  auth = "Bearer " .. os.getenv("BI_KEY")
  submitted, succeeded, failed, cached, polls = 0, 0, 0, 0, 0
  waiting = {}
end
function total(name)
  local sum = 0
  for _, thread in ipairs(threads) do sum = sum + thread:get(name) end
  return sum
end
"""
# api: submissions only.
WRK_SUBMIT = WRK_COMMON + """
request = job_request
function done(summary, latency, requests)
  local e = summary.errors
  local refused = e.status + e.connect + e.read + e.write + e.timeout
  io.write(string.format("WRK %d %d %f %f %f\\n", summary.requests, refused,
    summary.duration / 1e6, latency:percentile(50) / 1e3, latency:percentile(99) / 1e3))
end
"""
# burst: submissions only, each thread stopping once it has its share accepted.
WRK_BURST = WRK_COMMON + """
request = job_request
function response(status, headers, body)
  if status == 202 then
    accepted = (accepted or 0) + 1
    if accepted >= tonumber(os.getenv("BI_QUOTA")) then wrk.thread:stop() end
  end
end
"""
# e2e: a connection whose job was accepted (or whose long-poll ended before the job did)
# long-polls a waiting job next; with none waiting it submits a new one. Jobs in flight =
# connections, and a job counts once its read-back says succeeded.
WRK_E2E = WRK_COMMON + """
function request()
  local id = table.remove(waiting)
  if id == nil then return job_request() end
  polls = polls + 1
  return wrk.format("GET", "/v1/jobs/" .. id .. "?wait=30", {["Authorization"] = auth})
end
function response(status, headers, body)
  local state = body:match('"status"%s*:%s*"(%a+)"')
  if state == "queued" or state == "running" then
    table.insert(waiting, body:match('"id"%s*:%s*"([^"]+)"'))
  elseif state == "succeeded" then
    succeeded = succeeded + 1
    if not body:find('"cached"%s*:%s*null') then cached = cached + 1 end
  else
    failed = failed + 1
  end
end
function done(summary, latency, requests)
  io.write(string.format("WRK-E2E %d %d %d %d %d %f\\n", total("submitted"),
    total("succeeded"), total("failed"), total("cached"), total("polls"),
    summary.duration / 1e6))
end
"""


def started(root: Path, name: str, model_dir: Path, num_workers: int,
            api_processes: int = 1, settings: list[str] | None = None) -> UpProcess:
    """`batchinfer up` serving the tiny model with the tenant rate limit lifted, warmed up.

    One job is submitted (and, with a worker, awaited) first: the first submission loads
    the tokenizer and connects the producer, the first job waits for the worker to join.
    """
    env = {"BATCHINFER_MODEL": str(model_dir), "BATCHINFER_TENANT_RATE_LIMIT_PER_S": "1e9",
           "BATCHINFER_LOG_LEVEL": "WARNING", "BATCHINFER_API_PROCESSES": str(api_processes)}
    for setting in settings or []:
        key, sep, value = setting.partition("=")
        if not sep or not key.startswith("BATCHINFER_"):
            raise SystemExit(f"--set takes BATCHINFER_NAME=VALUE, got {setting!r}")
        env[key] = value
    up = start_up(root / name, free_port(), num_workers=num_workers,
                  log_path=root / f"{name}.log", extra_env=env)
    with httpx.Client(base_url=up.url, headers=up.headers, timeout=300) as client:
        created = client.post("/v1/jobs", json=job_body(str(model_dir), "warm-up", 0))
        created.raise_for_status()
        job_id = created.json()["id"]
        deadline = time.monotonic() + 300
        while num_workers and time.monotonic() < deadline:
            job = client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
            if job["status"] not in ("queued", "running"):
                break
    return up


def print_cpu(title: str, spent: dict[str, float], num_jobs: int) -> None:
    """CPU milliseconds per job of every role."""
    total = sum(spent.values())
    parts = ", ".join(f"{role} {1e3 * s / num_jobs:.2f}" for role, s in
                      sorted(spent.items(), key=lambda kv: -kv[1]))
    print(f"  {title} CPU ms per job: {parts} (total {1e3 * total / num_jobs:.2f})")


def run_wrk(up: UpProcess, model: str, script_text: str, tag: str,
            seconds: float, in_flight: int, **extra_env: str) -> tuple[str, float]:
    """wrk (2 threads, `in_flight` connections) with a Lua script: its output, its CPU s."""
    script = up.log_path.parent / f"{tag}.lua"
    script.write_text(script_text)
    env = dict(os.environ, BI_KEY=up.api_key, BI_MODEL=model, BI_TAG=tag, **extra_env)
    wrk = subprocess.Popen(["wrk", "-t2", f"-c{in_flight}", f"-d{seconds:.0f}s",
                            "--timeout", "60s", "-s", str(script), up.url],
                           stdout=subprocess.PIPE, text=True, env=env)
    ps = psutil.Process(wrk.pid)
    wrk_cpu = 0.0
    while wrk.poll() is None:
        try:
            times = ps.cpu_times()
            wrk_cpu = times.user + times.system
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    return wrk.communicate()[0], wrk_cpu


def wrk_phase(up: UpProcess, model: str, script_text: str, tag: str, seconds: float,
              marker: str, in_flight: int, **extra_env: str,
              ) -> tuple[list[str], dict[str, float]] | None:
    """Run wrk with a script: the fields of its summary line and the CPU seconds by role
    (wrk's own included), or None (said) when it printed no summary."""
    before = cpu_seconds_by_pid(up)
    out, wrk_cpu = run_wrk(up, model, script_text, tag, seconds, in_flight, **extra_env)
    spent = cpu_seconds_by_role(before, cpu_seconds_by_pid(up))
    spent["load generator (wrk)"] = wrk_cpu
    line = next((line for line in out.splitlines() if line.startswith(marker + " ")), None)
    if line is None:
        print(f"  wrk printed no summary:\n{out}")
        return None
    return line.split()[1:], spent


def api_phase(up: UpProcess, model: str, seconds: float,
              in_flight: int = IN_FLIGHT) -> None:
    """wrk against POST /v1/jobs with no worker running."""
    ran = wrk_phase(up, model, WRK_SUBMIT, "api", seconds, "WRK", in_flight)
    if ran is None:
        return
    (requests, refused, duration, p50, p99), spent = ran
    accepted = int(requests) - int(refused)
    print(f"api      {accepted / float(duration):8.0f} accepted submissions/s "
          f"({accepted} in {float(duration):.1f} s, {refused} refused), p50 {float(p50):.1f} ms, "
          f"p99 {float(p99):.1f} ms, {in_flight} in flight")
    print_cpu("api", spent, max(1, accepted))


def e2e_phase(up: UpProcess, model: str, seconds: float,
              in_flight: int = IN_FLIGHT) -> None:
    """wrk keeps `in_flight` jobs in flight, each submitted, then long-polled until done."""
    ran = wrk_phase(up, model, WRK_E2E, "e2e", seconds, "WRK-E2E", in_flight)
    if ran is None:
        return
    fields, spent = ran
    submitted, succeeded, failed, cached, polls = (int(f) for f in fields[:5])
    duration = float(fields[5])
    print(f"e2e      {succeeded / duration:8.0f} jobs/s ({succeeded} succeeded in {duration:.1f} "
          f"s; {submitted} submitted, {failed} failed, {cached} answered from a cache, "
          f"{polls} long-polls; over HTTP with wrk, {in_flight} in flight)")
    print_cpu("e2e", spent, max(1, succeeded))


def burst_phase(up: UpProcess, model: str, num_jobs: int,
                in_flight: int = IN_FLIGHT) -> None:
    """wrk POSTs `num_jobs` jobs as fast as the API takes them; then wait until every
    accepted job ended and time both from the jobs' stored times."""
    before = cpu_seconds_by_pid(up)
    script = up.log_path.parent / "burst.lua"
    script.write_text(WRK_BURST)
    env = dict(os.environ, BI_KEY=up.api_key, BI_MODEL=model, BI_TAG="burst",
               BI_QUOTA=str(-(-num_jobs // 2)))
    # Each wrk thread stops once its share is accepted, but wrk itself runs out its
    # duration: it is stopped once the database holds every job.
    wrk = subprocess.Popen(["wrk", "-t2", f"-c{in_flight}", "-d600s", "--timeout", "60s",
                            "-s", str(script), up.url], stdout=subprocess.DEVNULL, env=env)
    database = up.log_path.parent / "burst" / "batchinfer.db"
    query = ("SELECT count(*), coalesce(sum(status NOT IN ('queued', 'running')), 0), "
             "coalesce(sum(status = 'succeeded'), 0), min(created_at), max(created_at), "
             "max(finished_at) FROM jobs WHERE request LIKE '%burst %'")
    deadline = time.monotonic() + 600
    wrk_cpu = 0.0
    while time.monotonic() < deadline:
        with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
            total, ended, succeeded, first, last_in, last_out = db.execute(query).fetchone()
        if wrk.poll() is None and total >= num_jobs:
            times = psutil.Process(wrk.pid).cpu_times()
            wrk_cpu = times.user + times.system
            wrk.terminate()
            wrk.wait()
        if wrk.poll() is not None and ended == total:
            break
        time.sleep(0.2)
    spent = cpu_seconds_by_role(before, cpu_seconds_by_pid(up))
    spent["load generator (wrk)"] = wrk_cpu
    if wrk.poll() is None or not total or ended < total:
        wrk.kill()
        print(f"burst    did not drain in 600 s ({ended} of {total} ended)")
        return
    first_at = datetime.fromisoformat(first)
    submit_s = (datetime.fromisoformat(last_in) - first_at).total_seconds()
    drain_s = (datetime.fromisoformat(last_out) - first_at).total_seconds()
    print(f"burst    {succeeded / drain_s:8.0f} jobs/s end to end ({succeeded} of {total} "
          f"succeeded, first accepted to last finished {drain_s:.1f} s); went in at "
          f"{total / submit_s:.0f}/s ({submit_s:.1f} s, {in_flight} connections)")
    print_cpu("burst", spent, max(1, succeeded))


async def _client(url: str, key: str, model: str, tag: str, num_jobs: int,
                  in_flight: int) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=in_flight)
    done = 0
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=120) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(num_jobs):
            queue.put_nowait(i)

        async def run() -> None:
            nonlocal done
            while not queue.empty():
                i = queue.get_nowait()
                created = await client.post("/v1/jobs", json=job_body(model, tag, i))
                created.raise_for_status()
                job_id = created.json()["id"]
                while True:
                    job = (await client.get(f"/v1/jobs/{job_id}", params={"wait": 30})).json()
                    if job["status"] not in ("queued", "running"):
                        break
                if job["status"] != "succeeded":
                    raise RuntimeError(f"job {job_id} ended {job['status']}: {job.get('error')}")
                done += 1

        await asyncio.gather(*(run() for _ in range(in_flight)))
    return done


def e2e_python_phase(up: UpProcess, model: str, num_jobs: int) -> None:
    """Python client processes keep IN_FLIGHT jobs in flight, each submitted and long-polled
    and its result read back in full (they cost about as much CPU as the API does)."""
    per_process = num_jobs // CLIENT_PROCESSES
    before = cpu_seconds_by_pid(up)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started_at = time.perf_counter()
    clients = [
        subprocess.Popen([sys.executable, "-m", "bench.service_overhead", "--client", up.url,
                          up.api_key, model, f"e2e{n}", str(per_process),
                          str(IN_FLIGHT // CLIENT_PROCESSES)], stdout=subprocess.PIPE, text=True)
        for n in range(CLIENT_PROCESSES)
    ]
    finished = 0
    for client in clients:
        out = client.communicate()[0]
        finished += int(out.split()[-1]) if out.strip() else 0
    seconds = time.perf_counter() - started_at
    # The clients are reaped children now: their CPU time is in RUSAGE_CHILDREN.
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    client_cpu = (children.ru_utime + children.ru_stime
                  - children_before.ru_utime - children_before.ru_stime)
    spent = cpu_seconds_by_role(before, cpu_seconds_by_pid(up))
    spent["load generator (python)"] = client_cpu
    print(f"e2e-python {finished / seconds:6.0f} jobs/s ({finished} of {num_jobs} succeeded in "
          f"{seconds:.1f} s; submitted over HTTP, read back by long-poll, {IN_FLIGHT} in flight)")
    print_cpu("e2e-python", spent, max(1, finished))


def batch_phase(up: UpProcess, model: str, num_lines: int) -> None:
    """Upload a JSONL batch of 1-token requests, wait for it, download its output."""
    api = next(p for p in [psutil.Process(up.process.pid), *up.descendants()]
               if "-m cli" in " ".join(p.cmdline()))
    rss_before = api.memory_info().rss
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                "body": job_body(model, "batch", i)}) + "\n"
                    for i in range(num_lines))
    started_at = time.perf_counter()
    rss_peak = rss_before
    before, client_before = cpu_seconds_by_pid(up), time.process_time()
    with httpx.Client(base_url=up.url, headers=up.headers, timeout=300) as client:
        upload = client.post("/v1/files", data={"purpose": "batch"},
                             files={"file": ("batch.jsonl", lines.encode())})
        upload.raise_for_status()
        batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                                 "endpoint": "/v1/completions",
                                                 "completion_window": "24h"}).json()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            rss_peak = max(rss_peak, api.memory_info().rss)
            # Held open until the batch ends or half a second passes: its end is seen
            # within moments, not up to a polling interval late.
            batch = client.get(f"/v1/batches/{batch['id']}", params={"wait": 0.5}).json()
        output = client.get(f"/v1/files/{batch['output_file_id']}/content")
        output.raise_for_status()
    seconds = time.perf_counter() - started_at
    spent = cpu_seconds_by_role(before, cpu_seconds_by_pid(up))
    spent["client (upload, polls, download)"] = time.process_time() - client_before
    num_out = output.text.count("\n")
    print(f"batch    {seconds:8.1f} s for {num_lines} lines ({batch['status']}, {num_out} output "
          f"lines, {batch['request_counts']}); API RSS {rss_before / 2**20:.0f} MiB before, "
          f"{rss_peak / 2**20:.0f} MiB peak")
    print("  batch phases: " + ", ".join(
        f"{name} {batch[end] - batch[begin]:.0f} s" for name, begin, end in (
            ("validating", "created_at", "in_progress_at"),
            ("in progress", "in_progress_at", "finalizing_at"),
            ("finalizing", "finalizing_at", "completed_at"))))
    print_cpu("batch", spent, num_lines)


def idle_phase(up: UpProcess, seconds: float) -> None:
    """CPU milliseconds a second of every process while nothing is asked of the service."""
    time.sleep(5)  # past the warm-up job's aftermath (commits, cache stats, callbacks)
    before = cpu_seconds_by_pid(up)
    time.sleep(seconds)
    spent = cpu_seconds_by_role(before, cpu_seconds_by_pid(up))
    parts = ", ".join(f"{role} {1e3 * s / seconds:.1f}"
                      for role, s in sorted(spent.items(), key=lambda kv: -kv[1]))
    print(f"idle     {1e3 * sum(spent.values()) / seconds:8.1f} ms of CPU a second over "
          f"{seconds:.0f} s: {parts}")


def main() -> None:
    """Run the phases and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api-seconds", type=float, default=10.0)
    parser.add_argument("--e2e-seconds", type=float, default=20.0)
    parser.add_argument("--set", action="append", metavar="BATCHINFER_NAME=VALUE",
                        help="a setting for the service under test (repeatable)")
    parser.add_argument("--api-processes", type=int, default=1,
                        help="API processes `up` serves the port with")
    parser.add_argument("--e2e-jobs", type=int, default=5000, help="for e2e-python")
    parser.add_argument("--batch-lines", type=int, default=50_000)
    parser.add_argument("--burst-jobs", type=int, default=6000)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT,
                        help="wrk connections of the api and e2e phases: 32 is what the "
                        "targets are stated at; more shows what the machine carries once "
                        "the client's own latency stops setting the pace")
    parser.add_argument("--phases", nargs="+", default=["engine", "api", "e2e", "batch", "idle"],
                        choices=["engine", "api", "e2e", "burst", "e2e-python", "batch",
                                 "idle"],
                        help="which phases to run")
    parser.add_argument("--client", nargs=6, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        url, key, model, tag, num_jobs, in_flight = args.client
        print(asyncio.run(_client(url, key, model, tag, int(num_jobs), int(in_flight))))
        return
    if {"api", "e2e", "burst"} & set(args.phases) and shutil.which("wrk") is None:
        sys.exit("the api and e2e phases need wrk on PATH (Debian: apt-get install wrk); "
                 "or leave them out: --phases engine e2e-python batch")
    root = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    try:
        run_phases(args, root)
    finally:
        # Each phase's data folder (database, broker log) is ~150 MB after a batch.
        shutil.rmtree(root, ignore_errors=True)


def run_phases(args: argparse.Namespace, root: Path) -> None:
    """The chosen phases, each against its own service under `root`."""
    model_dir = root / "tiny-llama"
    save_tiny_llama(model_dir)
    model = str(model_dir)
    print(f"machine: {machine()}")
    print("tenant rate limit lifted for the run (BATCHINFER_TENANT_RATE_LIMIT_PER_S=1e9)")
    if "engine" in args.phases:
        rate = engine_jobs_per_second(model_dir, 2000)
        print(f"engine   {rate:8.0f} jobs/s (LLM.generate, "
              "1 token each)")
    in_flight = args.in_flight
    for name, workers, phase in (("api", 0, lambda up: api_phase(up, model, args.api_seconds,
                                                                 in_flight)),
                                 ("e2e", 1, lambda up: e2e_phase(up, model, args.e2e_seconds,
                                                                 in_flight)),
                                 ("burst", 1, lambda up: burst_phase(up, model, args.burst_jobs,
                                                                     in_flight)),
                                 ("e2e-python", 1,
                                  lambda up: e2e_python_phase(up, model, args.e2e_jobs)),
                                 ("batch", 1, lambda up: batch_phase(up, model,
                                                                     args.batch_lines)),
                                 ("idle", 1, lambda up: idle_phase(up, args.idle_seconds))):
        if name not in args.phases:
            continue
        up = started(root, name, model_dir, workers, args.api_processes, args.set)
        try:
            phase(up)
        finally:
            stop_service(up)


if __name__ == "__main__":
    main()
