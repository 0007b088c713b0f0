"""Prefix reuse across two workers: affinity keys vs random keys, Redis KV tier on vs off.

Jobs share a few long system prompts (default 200 jobs, 8 prompts of ~1,000 tokens, each
job its own question after it). Four runs, each on a fresh `batchinfer up` with 2 workers
(fresh pools, fresh Redis), never two at once:

  affinity           message key = hash of the first prompt block (the default): jobs of a
                     prompt meet on one partition, hence one worker's warm prefix cache
  random             an explicit random `cache_key` per job: prompts spread over both workers
  affinity + tier    as affinity, with BATCHINFER_KV_TIER_ENABLED
  random + tier      as random, with the tier: a worker loads what the other computed

All jobs are POSTed first (a backlog), then awaited. Per run: the engine prefix-cache hit
rate (cached / prompt tokens, from each job's usage), prefill tokens computed
(prompt - cached), the share of the shared-prefix tokens that were not computed, KV tier
blocks loaded (GET /v1/cache/stats), and the wall time from first POST to last result.
Every job asks its own question, so no result cache can answer it and every job runs in
the engine (`cache.mode: off` is no way to say so: it bypasses the prefix caches too).

    .venv/bin/python -m bench.prefix_reuse [--model smollm2-135m-instruct --num-jobs 200
        --num-prompts 8 --prompt-tokens 1000 --max-tokens 8 --kv-cache-bytes N --write-through]

`--kv-cache-bytes` shrinks each worker's pool so prefixes are evicted (the tier then
serves a worker's own evictions too).
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from bench.engine_throughput import machine
from core.settings import get_settings
from scheduler.embedded_services import free_port
from tests.utils.up_process import UpProcess, start_up
from workers.engine.registry import resolve_model

logger = logging.getLogger(__name__)

WORDS = ("river", "stone", "ledger", "orbit", "candle", "harbor", "meadow", "signal", "copper",
         "lantern", "archive", "compass", "thread", "glacier", "market", "violet", "engine",
         "parcel", "summit", "falcon", "garden", "quartz", "willow", "beacon")  # fmt: skip
LONG_POLL_S = 30.0


@dataclass(slots=True)
class RunResult:
    """One configuration's figures."""

    name: str
    num_jobs: int
    prompt_tokens: int
    cached_tokens: int
    shared_tokens: int
    kv_tier_hits: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from an engine's prefix cache (tier loads included)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the engines computed."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def shared_saved(self) -> float:
        """Share of the system-prompt tokens that were not computed."""
        return min(1.0, self.cached_tokens / self.shared_tokens) if self.shared_tokens else 0.0


def system_prompts(tokenizer: Any, num_prompts: int, num_tokens: int, seed: int) -> list[str]:
    """`num_prompts` distinct texts of about `num_tokens` tokens each."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        words = [f"Context {i}:"]
        while len(tokenizer(" ".join(words)).input_ids) < num_tokens:
            words += [rng.choice(WORDS) for _ in range(max(4, num_tokens // 100))]
        prompts.append(" ".join(words))
    return prompts


def job_bodies(model: str, systems: list[str], num_jobs: int, *, random_keys: bool,
               max_tokens: int, seed: int) -> tuple[list[dict[str, Any]], list[int]]:
    """Jobs cycling through the system prompts, and which prompt each uses."""
    rng = random.Random(seed)
    bodies, which = [], []
    for i in range(num_jobs):
        k = rng.randrange(len(systems))
        body: dict[str, Any] = {
            "model": model, "prompt": f"{systems[k]}\nQuestion {i}: what comes next?",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if random_keys:
            body["cache_key"] = uuid.uuid4().hex
        bodies.append(body)
        which.append(k)
    return bodies, which


def run_config(root: Path, name: str, model: str, bodies: list[dict[str, Any]],
               shared_tokens: int, env: dict[str, str]) -> RunResult:
    """One fresh `batchinfer up` with 2 workers; submit everything, await everything."""
    up = start_up(root / name, free_port(), num_workers=2, log_path=root / f"{name}.log",
                  extra_env={"BATCHINFER_MODEL": model, "BATCHINFER_LOG_LEVEL": "WARNING",
                             "BATCHINFER_TENANT_RATE_LIMIT_PER_S": "1e9",
                             "BATCHINFER_CACHE_STATS_INTERVAL_S": "1", **env})  # fmt: skip
    try:
        with httpx.Client(base_url=up.url, headers=up.headers, timeout=300) as client:
            wait_until_workers_join(up, client, model)
            started = time.perf_counter()
            job_ids = [submit(client, body) for body in bodies]
            with ThreadPoolExecutor(8) as pool:
                jobs = list(pool.map(lambda job_id: await_job(up, job_id), job_ids))
            seconds = time.perf_counter() - started
            time.sleep(2.5)  # one more publication of the workers' cache counters
            stats = client.get("/v1/cache/stats").json()
            logger.info("cache stats of %s: %s", name, stats)
        failed = [j for j in jobs if j["status"] != "succeeded"]
        if failed:
            raise RuntimeError(f"{name}: {len(failed)} jobs did not succeed, e.g. "
                               f"{failed[0]['id']}: {failed[0]['status']} {failed[0]['error']}")
        usage = [j["usage"] for j in jobs]
        return RunResult(
            name, len(jobs), sum(u["prompt_tokens"] for u in usage),
            sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usage),
            shared_tokens, stats["totals"]["kv"]["hits"], seconds)  # fmt: skip
    finally:
        up.stop()


def wait_until_workers_join(up: UpProcess, client: httpx.Client, model: str) -> None:
    """One tiny job through, so group joins and model loads are not timed."""
    job = submit(client, {"model": model, "prompt": "warm up", "max_tokens": 1,
                          "temperature": 0, "cache": {"mode": "off"}})  # fmt: skip
    await_job(up, job, timeout=600)


def submit(client: httpx.Client, body: dict[str, Any]) -> str:
    """POST /v1/jobs; the job id."""
    created = client.post("/v1/jobs", json=body)
    created.raise_for_status()
    return str(created.json()["id"])


def await_job(up: UpProcess, job_id: str, timeout: float = 3600) -> dict[str, Any]:
    """The finished job, long-polling."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=up.url, headers=up.headers, timeout=LONG_POLL_S + 30) as c:
        while True:
            job: dict[str, Any] = c.get(f"/v1/jobs/{job_id}",
                                        params={"wait": LONG_POLL_S}).json()  # fmt: skip
            if job["status"] not in ("queued", "running") or time.monotonic() > deadline:
                return job


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-jobs", type=int, default=200)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-bytes", type=int, default=None,
                        help="each worker's KV pool (default: the engine's own sizing)")
    parser.add_argument("--write-through", action="store_true",
                        help="tier runs store every block once computed")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only these configurations (affinity, random, ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="log each run's cache stats")
    args = parser.parse_args()
    if min(args.num_jobs, args.num_prompts, args.prompt_tokens, args.max_tokens) < 1:
        parser.error("--num-jobs, --num-prompts, --prompt-tokens and --max-tokens must be >= 1")
    return args


def main() -> None:
    """Run the four configurations and print their figures."""
    args = parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model,
                                                            get_settings().models_dir))
    systems = system_prompts(tokenizer, args.num_prompts, args.prompt_tokens, args.seed)
    system_lens = [len(tokenizer(s).input_ids) for s in systems]
    base_env = {}
    if args.kv_cache_bytes:
        base_env["BATCHINFER_ENGINE_KV_CACHE_MEMORY_BYTES"] = str(args.kv_cache_bytes)
    tier_env = {**base_env, "BATCHINFER_KV_TIER_ENABLED": "true",
                "BATCHINFER_KV_TIER_WRITE_THROUGH": str(args.write_through).lower()}
    configs = [(name, env) for name, env in (("affinity", base_env), ("random", base_env),
               ("affinity+tier", tier_env), ("random+tier", tier_env))
               if args.only is None or name in args.only]  # fmt: skip
    print(f"# prefix_reuse on {machine()}")  # noqa: T201
    print(f"# {args.num_jobs} jobs, {args.num_prompts} system prompts of "  # noqa: T201
          f"{min(system_lens)}-{max(system_lens)} tokens, max_tokens {args.max_tokens}, "
          f"model {args.model}, 2 workers")
    root = Path(tempfile.mkdtemp(prefix="prefix-reuse-"))  # kept: each run's logs
    print(f"# logs under {root}")  # noqa: T201
    for name, env in configs:
        bodies, which = job_bodies(args.model, systems, args.num_jobs,
                                   random_keys=name.startswith("random"),
                                   max_tokens=args.max_tokens, seed=args.seed)  # fmt: skip
        shared = sum(system_lens[k] for k in which)
        result = run_config(root, name, args.model, bodies, shared, env)
        print(format_row(result), flush=True)  # noqa: T201


def format_row(r: RunResult) -> str:
    """One line of figures."""
    return (f"{r.name:>14}: prefix-cache hit rate {r.hit_rate:6.1%}, prefill tokens computed "
            f"{r.prefill_tokens:>7} of {r.prompt_tokens}, shared-prefix tokens saved "
            f"{r.shared_saved:6.1%}, KV tier blocks loaded {r.kv_tier_hits:>5}, "
            f"wall {r.seconds:7.1f} s")


if __name__ == "__main__":
    main()
