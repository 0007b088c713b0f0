"""Throughput of the whole service beside the engine alone, on the same prompts; API rate.

Rounds of two phases, then a third; never two at once (they share the CPU):

  engine   `workers.engine.LLM.generate` on every prompt at once, with the engine options
           the inference worker takes from settings (`workers.inference.runner.build_engine`)
  service  `batchinfer up` with one worker on a fresh data directory: every job is POSTed
           to /v1/jobs first, so the worker has a backlog from the start (saturation), then
           each is awaited (`?wait=` long-polls, or polling the job list); the clock runs
           from the first POST until the client has seen the last job finished
  api      a fresh `batchinfer up` with no worker (so no engine competes for the CPU):
           concurrent submitters POST jobs for a bounded number or duration; submissions/s
           and p50/p99 latency. The jobs stay queued and go with the data directory

Each round sends fresh prompts through both sides, greedy with `ignore_eos` and a fixed
`max_tokens`, so both produce the same tokens, and compares the texts. The best round of
each side is compared (on a shared CPU other work only ever slows a phase down); target:
service / engine >= 0.90. Where the service's time went is printed from the job rows'
timestamps and the CPU seconds of every process of the `up` tree.

    .venv/bin/python -m bench.service_throughput [--num-prompts 256 --max-tokens 64 --rounds 3]

Engine options come from the `BATCHINFER_ENGINE_*` settings; those and `BATCHINFER_WORKER_*`
are passed on to the service, so both sides run the same engine.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
from sqlalchemy import select

from bench.engine_throughput import machine
from bench.role_cpu import cpu_seconds_by_pid, cpu_seconds_by_role
from core.settings import Settings, get_settings
from scheduler.embedded_services import free_port
from storage.db import create_db_engine, session_factory
from storage.models import Job
from tests.utils.up_process import UpProcess, start_up
from workers.engine import LLM, RequestOutput, SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.registry import KNOWN_MODELS, pull_model

logger = logging.getLogger(__name__)
T = TypeVar("T")

TOPICS = ["the moon", "bread", "rivers", "chess", "owls", "volcanoes", "jazz", "glass", "tea",
          "bicycles", "glaciers", "printing presses", "honeybees", "lighthouses", "paper"]
ASKS = ["Explain how it works.", "Give one surprising fact.", "Describe its history briefly.",
        "Who would find it useful, and why?", "Compare it with something familiar.",
        "What is a common misconception about it?", "Write two sentences for a child."]
# Settings the service inherits from this environment: whatever shapes the engine and the
# worker. The rest (ports, database, broker) `batchinfer up` chooses itself.
FORWARDED_ENV_PREFIXES = ("BATCHINFER_ENGINE_", "BATCHINFER_WORKER_", "BATCHINFER_LOG_LEVEL")
WARMUP_JOBS = 2
LONG_POLL_S = 30.0


@dataclass(slots=True)
class Throughput:
    """One side's run over the same jobs."""

    name: str
    seconds: float
    num_jobs: int
    num_output_tokens: int
    cpu_seconds: float
    load_1m: float  # the 1-minute load average when it started (the CPU may be shared)

    def line(self) -> str:
        """The table row."""
        return (f"{self.name:<8} {self.seconds:8.1f} s  {self.num_jobs / self.seconds:7.2f} jobs/s"
                f"  {self.num_output_tokens / self.seconds:8.1f} output tokens/s"
                f"  (load {self.load_1m:.2f})")

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second."""
        return self.num_output_tokens / self.seconds


def make_messages(num_prompts: int, seed: int, tag: str = "") -> list[list[dict[str, str]]]:
    """Distinct one-turn chats of varied length (no result-cache hits), reproducible."""
    rng = random.Random(seed)
    chats = []
    for i in range(num_prompts):
        asks = " ".join(rng.sample(ASKS, rng.randint(1, 4)))
        content = f"{tag}Request {i}: {rng.choice(TOPICS)}. {asks}"
        chats.append([{"role": "user", "content": content}])
    return chats


def job_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A greedy chat job that produces exactly max_tokens tokens."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def engine_options(settings: Settings) -> dict[str, Any]:
    """The options `workers.inference.runner.build_engine` gives the worker's engine."""
    options = {"models_dir": settings.models_dir, "dtype": settings.engine_dtype,
               "device": settings.engine_device,
               "max_num_batched_tokens": settings.engine_max_num_batched_tokens,
               "kv_cache_memory_bytes": settings.engine_kv_cache_memory_bytes}
    if settings.engine_max_num_seqs is not None:
        options["max_num_seqs"] = settings.engine_max_num_seqs
    return options


class OfflineEngine:
    """The engine alone, loaded and warmed up: `LLM.generate` of every prompt at once, timed.

    It steps on a thread of its own, as in the worker (`EngineLoop`), unless told to use
    the main thread. That matters on a shared CPU: torch's OpenMP team of the main thread
    busy-waits between parallel regions, and with more runnable threads than cores the
    same engine ran up to 7x slower there (2-core CPU at load 5; OMP_WAIT_POLICY=PASSIVE
    closes the gap).
    """

    def __init__(self, settings: Settings, *, on_main_thread: bool = False) -> None:
        self._pool = None if on_main_thread else ThreadPoolExecutor(1, "engine")
        # Loaded on the thread that steps it, so that it has the only OpenMP team, as the
        # worker's engine has (`built_on_a_passing_thread`).
        self.llm = self._on_engine_thread(
            lambda: LLM(model=settings.model, **engine_options(settings)))
        warmup = make_messages(WARMUP_JOBS, seed=1, tag="warm-up ")
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        self._on_engine_thread(lambda: self.llm.generate(warmup, params))

    def _on_engine_thread(self, fn: Callable[[], T]) -> T:
        return fn() if self._pool is None else self._pool.submit(fn).result()

    def run(
        self, chats: list[list[dict[str, str]]], max_tokens: int
    ) -> tuple[Throughput, list[str]]:
        """Every prompt submitted at once, run to completion; the figures and output texts."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        before = self.llm.engine.stats()

        def generate() -> tuple[list[RequestOutput], float, float]:
            start, cpu_start = time.perf_counter(), time.process_time()
            outputs = self.llm.generate(chats, params)
            return outputs, time.perf_counter() - start, time.process_time() - cpu_start

        load_1m = os.getloadavg()[0]
        outputs, seconds, cpu_seconds = self._on_engine_thread(generate)
        produced = [len(o.token_ids) for o in outputs]
        if produced != [max_tokens] * len(chats):
            raise RuntimeError("the engine did not produce exactly max_tokens tokens per prompt")
        stats = self.llm.engine.stats()
        print(f"  engine: {stats.num_preemptions - before.num_preemptions} preemptions, "
              f"{stats.num_computed_tokens - before.num_computed_tokens} tokens computed, "
              f"{cpu_seconds:.1f} CPU s")
        result = Throughput("engine", seconds, len(chats), sum(produced), cpu_seconds, load_1m)
        return result, [o.text for o in outputs]

    def close(self) -> None:
        """Stop the engine thread."""
        if self._pool is not None:
            self._pool.shutdown()


@dataclass(slots=True)
class ServiceRun:
    """The service phase as the client saw it, and the finished jobs in submission order."""

    seconds: float
    submit_seconds: float
    jobs: list[dict[str, Any]]
    role_to_cpu_seconds: dict[str, float]


async def submit_all(
    client: httpx.AsyncClient, bodies: list[dict[str, Any]], concurrency: int
) -> list[str]:
    """POST every body with `concurrency` requests in flight; job ids in body order."""
    gate = asyncio.Semaphore(concurrency)

    async def submit(body: dict[str, Any]) -> str:
        async with gate:
            response = await client.post("/v1/jobs", json=body)
        if response.status_code != 202:
            raise RuntimeError(f"POST /v1/jobs: {response.status_code} {response.text}")
        return str(response.json()["id"])

    return list(await asyncio.gather(*(submit(b) for b in bodies)))


async def wait_all(
    client: httpx.AsyncClient, job_ids: list[str], *, mode: str, concurrency: int,
    timeout: float,
) -> list[dict[str, Any]]:
    """Each job once finished: long-polled one by one, or polled through the job list."""
    deadline = time.monotonic() + timeout
    if mode == "poll":
        for status in ("queued", "running"):
            while (await client.get("/v1/jobs", params={"status": status, "limit": 1})
                   ).json()["data"]:  # fmt: skip
                if time.monotonic() > deadline:
                    raise TimeoutError(f"jobs still {status} after {timeout:.0f} s")
                await asyncio.sleep(0.2)
    gate = asyncio.Semaphore(concurrency)

    async def finished(job_id: str) -> dict[str, Any]:
        async with gate:
            while True:
                wait = LONG_POLL_S if mode == "long-poll" else 0
                try:
                    response = await client.get(f"/v1/jobs/{job_id}", params={"wait": wait})
                except httpx.TimeoutException:
                    response = None  # a starved CPU can hold a reply past the client timeout
                job: dict[str, Any] = response.json() if response else {"status": "unknown"}
                if job["status"] not in ("queued", "running", "unknown"):
                    return job
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} still {job['status']} after {timeout:.0f} s")

    return list(await asyncio.gather(*(finished(j) for j in job_ids)))


async def run_service_jobs(
    up: UpProcess, model: str, bodies: list[dict[str, Any]], args: argparse.Namespace
) -> ServiceRun:
    """Warm the worker up, then submit every job and wait for all of them."""
    limits = httpx.Limits(max_connections=args.concurrency + args.wait_concurrency)
    async with httpx.AsyncClient(base_url=up.url, headers=up.headers, timeout=120.0,
                                 limits=limits) as client:
        # The worker loads the model and joins the consumer group after `up` printed its
        # key; these jobs wait for that, outside the clock.
        warmup = [job_body(model, m, 4) for m in make_messages(WARMUP_JOBS, 1, "warm-up ")]
        ids = await submit_all(client, warmup, args.concurrency)
        await wait_all(client, ids, mode="long-poll", concurrency=len(ids), timeout=600.0)
        cpu_before, client_cpu_start = cpu_seconds_by_pid(up), time.process_time()
        start = time.perf_counter()
        job_ids = await submit_all(client, bodies, args.concurrency)
        submitted = time.perf_counter()
        jobs = await wait_all(client, job_ids, mode=args.wait, concurrency=args.wait_concurrency,
                              timeout=args.timeout)
        seconds = time.perf_counter() - start
        role_to_cpu = cpu_seconds_by_role(cpu_before, cpu_seconds_by_pid(up))
        role_to_cpu["client"] = time.process_time() - client_cpu_start
    return ServiceRun(seconds, submitted - start, jobs, role_to_cpu)


def print_timeline(database_url: str, job_ids: list[str], client_seconds: float) -> None:
    """Where the service's time went, from the job rows' own timestamps."""
    engine = create_db_engine(database_url)
    try:
        with session_factory(engine)() as session:
            rows = session.scalars(select(Job).where(Job.id.in_(job_ids))).all()
    finally:
        engine.dispose()

    def span(stamps: list[datetime | None]) -> tuple[datetime, datetime]:
        present = [s for s in stamps if s is not None]
        return min(present), max(present)

    created_first, created_last = span([r.created_at for r in rows])
    started_first, started_last = span([r.started_at for r in rows])
    finished_first, finished_last = span([r.finished_at for r in rows])
    waits = [(r.started_at - r.created_at).total_seconds() for r in rows if r.started_at]

    def at(moment: datetime) -> str:
        return f"+{(moment - created_first).total_seconds():6.2f} s"

    print(f"  jobs created   {at(created_first)} .. {at(created_last)}")
    print(f"  jobs started   {at(started_first)} .. {at(started_last)}  (claimed by the worker)")
    print(f"  jobs finished  {at(finished_first)} .. {at(finished_last)}")
    print(f"  queue wait     median {statistics.median(waits):.2f} s, max {max(waits):.2f} s")
    worker_s = (finished_last - started_first).total_seconds()
    print(f"  worker busy    {worker_s:.2f} s (first claim to last result stored); client saw "
          f"{client_seconds:.2f} s from its first POST")


@dataclass(slots=True)
class ApiRun:
    """The API phase: latencies of accepted submissions, and the refusals."""

    seconds: float
    latencies: list[float]
    num_refused: int

    def line(self) -> str:
        """Submissions/s and latency percentiles."""
        ms = sorted(x * 1e3 for x in self.latencies)
        p50 = ms[len(ms) // 2]
        p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        return (f"api      {self.seconds:8.1f} s  {len(ms) / self.seconds:7.1f} submissions/s  "
                f"p50 {p50:.1f} ms  p99 {p99:.1f} ms  max {ms[-1]:.1f} ms  "
                f"({len(ms)} accepted, {self.num_refused} refused)")


async def run_api(up: UpProcess, model: str, args: argparse.Namespace) -> ApiRun:
    """`concurrency` submitters POST jobs until api_requests are sent or api_duration passes."""
    chats = make_messages(args.api_requests, seed=args.seed + 1, tag="api ")
    bodies = [job_body(model, m, args.max_tokens) for m in chats]
    limits = httpx.Limits(max_connections=args.concurrency)
    latencies: list[float] = []
    num_refused = 0
    async with httpx.AsyncClient(base_url=up.url, headers=up.headers, timeout=60.0,
                                 limits=limits) as client:
        await submit_all(client, bodies[:WARMUP_JOBS], WARMUP_JOBS)  # connections, first imports
        next_body = iter(bodies[WARMUP_JOBS:])
        start = time.perf_counter()
        deadline = start + args.api_duration

        async def submitter() -> None:
            nonlocal num_refused
            for body in next_body:  # shared: each body is sent once
                if time.perf_counter() > deadline:
                    return
                sent = time.perf_counter()
                response = await client.post("/v1/jobs", json=body)
                if response.status_code == 202:
                    latencies.append(time.perf_counter() - sent)
                else:
                    num_refused += 1

        await asyncio.gather(*(submitter() for _ in range(args.concurrency)))
        seconds = time.perf_counter() - start
    return ApiRun(seconds, latencies, num_refused)


def started_service(root: Path, name: str, num_workers: int, model: str) -> UpProcess:
    """`batchinfer up` on a fresh data dir under root and a free port."""
    extra_env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    extra_env["BATCHINFER_MODEL"] = model
    root.mkdir(parents=True, exist_ok=True)
    return start_up(root / name, free_port(), num_workers=num_workers,
                    log_path=root / f"{name}.log", extra_env=extra_env)


def stop_service(up: UpProcess) -> None:
    """SIGTERM and wait; the whole tree if it does not stop."""
    try:
        code = up.stop(timeout=120.0)
    except Exception:
        up.kill_tree()
        raise
    if code != 0:
        print(f"  `batchinfer up` exited with {code}; log tail:\n{up.log_tail(2000)}")


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--num-prompts", type=int, default=128, help="jobs per phase (2x the default batch)")
    add("--rounds", type=int, default=2, help="engine-then-service rounds; best of each compared")
    add("--max-tokens", type=int, default=32, help="output tokens per job")
    add("--concurrency", type=int, default=16, help="submitters in flight")
    add("--wait", choices=["long-poll", "poll"], default="long-poll",
        help="how the client learns that jobs finished")
    add("--wait-concurrency", type=int, default=16, help="long-polls in flight at once")
    add("--timeout", type=float, default=1800.0, help="seconds per phase")
    add("--api-requests", type=int, default=3000, help="most submissions in the API phase")
    add("--api-duration", type=float, default=20.0, help="most seconds of the API phase")
    add("--skip-api", action="store_true")
    add("--engine-on-main-thread", action="store_true",
        help="step the engine-alone phase on the main thread (see OfflineEngine)")
    add("--seed", type=int, default=0)
    return parser.parse_args()


def run_service(
    root: Path, model: str, bodies: list[dict[str, Any]], args: argparse.Namespace
) -> tuple[Throughput, list[dict[str, Any]]]:
    """One service phase on a fresh `batchinfer up` under root; the figures and the jobs."""
    print(f"  service: `batchinfer up --workers 1`, {args.concurrency} submitters, {args.wait} "
          f"({args.wait_concurrency} at once)", flush=True)
    up = started_service(root, "service", 1, model)
    load_1m = os.getloadavg()[0]
    try:
        run = asyncio.run(run_service_jobs(up, model, bodies, args))
    finally:
        stop_service(up)
    unfinished = [j for j in run.jobs if j["status"] != "succeeded"]
    if unfinished:
        raise RuntimeError(f"{len(unfinished)} jobs did not succeed: {unfinished[:3]}")
    num_tokens = sum(int(j["usage"]["completion_tokens"]) for j in run.jobs)
    print(f"  submitted {len(bodies)} jobs in {run.submit_seconds:.2f} s "
          f"({len(bodies) / run.submit_seconds:.0f}/s)")
    print_timeline(f"sqlite:///{root / 'service' / 'batchinfer.db'}",
                   [j["id"] for j in run.jobs], run.seconds)
    cpu = ", ".join(f"{role} {seconds:.1f}" for role, seconds
                    in sorted(run.role_to_cpu_seconds.items(), key=lambda kv: -kv[1]))
    print(f"  CPU seconds: {cpu}")
    service = Throughput("service", run.seconds, len(run.jobs), num_tokens,
                         sum(run.role_to_cpu_seconds.values()), load_1m)
    return service, run.jobs


def print_summary(rounds: list[tuple[Throughput, Throughput]], api: ApiRun | None) -> None:
    """Every round, then the best of each side (interference only ever slows one down)."""
    print(f"\nsummary (load {os.getloadavg()[0]:.2f}):")
    for i, (engine, service) in enumerate(rounds, 1):
        print(f"  round {i}: {engine.line()}")
        print(f"  round {i}: {service.line()}   service / engine = "
              f"{service.tokens_per_s / engine.tokens_per_s:.2f}")
    engine = max((e for e, _ in rounds), key=lambda r: r.tokens_per_s)
    service = max((s for _, s in rounds), key=lambda r: r.tokens_per_s)
    ratio = service.tokens_per_s / engine.tokens_per_s
    verdict = "meets" if ratio >= 0.9 else "misses"
    print(f"  best of {len(rounds)}: engine {engine.tokens_per_s:.1f}, service "
          f"{service.tokens_per_s:.1f} output tokens/s; service / engine = {ratio:.2f} "
          f"({verdict} the 0.90 target)")
    engines, services = [e for e, _ in rounds], [s for _, s in rounds]
    engine_cpu = sum(e.num_output_tokens for e in engines) / sum(e.cpu_seconds for e in engines)
    service_cpu = sum(s.num_output_tokens for s in services) / sum(s.cpu_seconds for s in services)
    print(f"  output tokens per CPU second (all rounds): engine {engine_cpu:.1f}, service "
          f"{service_cpu:.1f} (service / engine = {service_cpu / engine_cpu:.2f})")
    if api is not None:
        print(f"  {api.line()}")


def main() -> None:
    """Rounds of engine then service on fresh prompts, then the API phase; the comparison."""
    logging.basicConfig(level=logging.WARNING)
    args = parse_args()
    settings = get_settings()
    model = settings.model
    if model in KNOWN_MODELS:
        pull_model(model, settings.models_dir)
    print(f"model {model}; {args.num_prompts} chat jobs x {args.max_tokens} output tokens, "
          f"greedy, ignore_eos; engine max_num_seqs "
          f"{settings.engine_max_num_seqs or EngineConfig(model).max_num_seqs}, "
          f"max_num_batched_tokens {settings.engine_max_num_batched_tokens or 'device default'}; "
          f"{machine()}")
    rounds: list[tuple[Throughput, Throughput]] = []
    api = None
    with tempfile.TemporaryDirectory(prefix="bench-service-") as tmp:
        for i in range(args.rounds):
            # Fresh prompts each round: the service's result cache must not answer them.
            chats = make_messages(args.num_prompts, args.seed + i, tag=f"r{i} ")
            print(f"round {i + 1} of {args.rounds}", flush=True)
            # Loaded per round and dropped before the service starts: the machine may be
            # short of memory, and an idle engine should not sit beside the service.
            engine = OfflineEngine(settings, on_main_thread=args.engine_on_main_thread)
            engine_run, texts = engine.run(chats, args.max_tokens)
            engine.close()
            del engine
            gc.collect()
            print(f"  {engine_run.line()}", flush=True)
            bodies = [job_body(model, m, args.max_tokens) for m in chats]
            service_run, jobs = run_service(Path(tmp) / f"round-{i + 1}", model, bodies, args)
            num_same = sum(j["result"]["choices"][0]["message"]["content"] == t
                           for j, t in zip(jobs, texts, strict=True))
            print(f"  {service_run.line()}; {service_run.num_output_tokens} output tokens vs "
                  f"{engine_run.num_output_tokens}, greedy texts identical for "
                  f"{num_same}/{len(jobs)} jobs", flush=True)
            rounds.append((engine_run, service_run))
        if not args.skip_api:
            print(f"api phase (load {os.getloadavg()[0]:.2f}): `batchinfer up --workers 0`, "
                  f"{args.concurrency} submitters, up to {args.api_requests} jobs or "
                  f"{args.api_duration:.0f} s", flush=True)
            up = started_service(Path(tmp), "api", 0, model)
            try:
                api = asyncio.run(run_api(up, model, args))
            finally:
                stop_service(up)
            print(api.line(), flush=True)
    print_summary(rounds, api)


if __name__ == "__main__":
    main()
