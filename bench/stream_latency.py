"""Time to the first streamed chunk of a `high` job on an idle service, against the
engine's own time to first token on the same prompts.

Two phases, one after the other (they would share the cores):

  engine   the worker's engine (`workers.inference.runner.build_engine`, the same
           settings) in this process: from `add_request` to the first step that returns
           a token, per prompt: the engine's own time to first token (TTFT)
  service  `batchinfer up --workers 1` (embedded broker, Redis, SQLite), idle; each
           prompt is POSTed to /v1/completions with `stream: true` (one at a time, one
           kept-alive connection) and the clock stops at the first chunk that carries
           text: time to first chunk (TTFC); the time to `[DONE]` too; and, beside each,
           the same prompt without `stream` and with `max_tokens: 1`: what the job path
           costs to the first token without streaming (the service's floor for TTFC)

Every request is distinct and sets `cache: {"mode": "off"}` (no result or prefix cache
answers it), so each runs its prompt's prefill in full. The figure the issue sets is
TTFC / TTFT <= 1.2; the difference is what the service adds in front of the engine
(HTTP, validation, the database insert, Kafka in and out, the claim, Redis both ways).
As the two phases run at different moments, each streamed job's own claim-to-first-token
time (from its row) is printed too, and what the service adds to each request beside it:
figures that a shared machine's changing load does not skew.

    .venv/bin/python -m bench.stream_latency [--model DIR_OR_NAME] [--trials 20] \
        [--prompt-words 100] [--max-tokens 16]

Without --model it runs the tiny random-weight Llama the tests use.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import tempfile
import time
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path

import httpx

from bench.engine_throughput import machine
from bench.service_overhead import started
from bench.service_throughput import stop_service
from core.settings import Settings
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import SamplingParams
from workers.inference.runner import build_engine

# (wall clock at the POST, wall clock at its first chunk with text)
Stamps = tuple[float, float]

WORDS = ("river stone cloud amber lantern meadow copper violet harbor thistle quiet "
         "orbit willow ember falcon marble tide juniper canyon").split()


def prompts(num: int, num_words: int) -> list[str]:
    """Distinct prompts of `num_words` words (distinct from their first word on)."""
    return [f"{i} " + " ".join(WORDS[(i + j * 7) % len(WORDS)] for j in range(num_words))
            for i in range(num)]


def engine_ttft(model: str, texts: list[str], max_tokens: int) -> list[float]:
    """Seconds from add_request to the first generated token, one prompt at a time."""
    engine = build_engine(Settings(model=model))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    params.use_prefix_cache = False
    times: list[float] = []
    for i, text in enumerate(["warm up " + texts[0], *texts]):
        request_id = f"r{i}"
        begun = time.perf_counter()
        engine.add_request(request_id, text, params)
        first: float | None = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if first is None and output.request_id == request_id and output.token_ids:
                    first = time.perf_counter() - begun
        assert first is not None
        if i:
            times.append(first)
    return times


def service_ttfc(url: str, headers: dict[str, str], model: str, texts: list[str],
                 max_tokens: int
                 ) -> tuple[list[float], list[float], list[float], list[str], list[Stamps]]:
    """Per prompt: seconds to the first chunk with text, to `[DONE]`, and of the same
    prompt's 1-token request without `stream`; the streamed jobs' ids; and the wall
    clock (epoch seconds) at each POST and at its first chunk."""
    firsts, totals, one_tokens, job_ids = [], [], [], []
    walls: list[Stamps] = []
    with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
        for i, text in enumerate(["warm up " + texts[0], *texts]):
            body = {"model": model, "prompt": text, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "cache": {"mode": "off"}}
            sent_wall, begun = time.time(), time.perf_counter()
            first: float | None = None
            first_wall = 0.0
            with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                job_id = response.headers["x-job-id"]
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        break
                    if (first is None and line.startswith("data: ")
                            and json.loads(line[6:])["choices"][0]["text"]):
                        first, first_wall = time.perf_counter() - begun, time.time()
            assert first is not None, "no chunk carried text"
            total = time.perf_counter() - begun
            begun = time.perf_counter()
            one = client.post("/v1/completions", json=body | {
                "prompt": "one " + text, "max_tokens": 1, "stream": False})
            one.raise_for_status()
            if i:
                firsts.append(first)
                totals.append(total)
                one_tokens.append(time.perf_counter() - begun)
                job_ids.append(job_id)
                walls.append((sent_wall, first_wall))
    return firsts, totals, one_tokens, job_ids, walls


def job_stamps(database: Path, job_ids: list[str]) -> list[tuple[float, ...]]:
    """Per job, in order, as epoch seconds: when its row was created, queued, claimed
    (`started_at`) and got its first token, as the API and the worker stored them."""
    columns = ("created_at", "queued_at", "started_at", "first_token_at")
    with closing(sqlite3.connect(database)) as db:
        rows = {row[0]: row[1:] for row in db.execute(
            f"SELECT id, {', '.join(columns)} FROM jobs WHERE id IN "
            f"({','.join('?' * len(job_ids))})", job_ids)}
    return [tuple(_epoch(stamp) for stamp in rows[job_id]) for job_id in job_ids]


def _epoch(stamp: str) -> float:
    moment = datetime.fromisoformat(stamp)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def stages(walls: list[Stamps], stamps: list[tuple[float, ...]]) -> dict[str, list[float]]:
    """Where each streamed request's time went, stage by stage (the client and the
    service share this machine's clock)."""
    names = ("POST to row created (HTTP, validation, insert)",
             "row created to queued (publish to the broker)",
             "queued to claimed (the broker to the worker, the claim)",
             "claimed to first token (the engine inside the service)",
             "first token to the client's first chunk (Redis, the API, HTTP)")
    out: dict[str, list[float]] = {name: [] for name in names}
    for (sent, first_chunk), row in zip(walls, stamps, strict=True):
        moments = (sent, *row, first_chunk)
        for name, start, end in zip(names, moments[:-1], moments[1:], strict=True):
            out[name].append(end - start)
    return out


def summary(name: str, seconds: list[float]) -> str:
    """Median, min and max in milliseconds."""
    ms = [1e3 * s for s in seconds]
    return (f"{name}: median {statistics.median(ms):.1f} ms "
            f"(min {min(ms):.1f}, max {max(ms):.1f}, n={len(ms)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model name or directory (default: the tiny Llama)")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(f"load before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="stream-latency-") as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            save_tiny_llama(root / "tiny")
            model = str(root / "tiny")
        texts = prompts(args.trials, args.prompt_words)
        ttft = engine_ttft(model, texts, args.max_tokens)
        print(summary("engine TTFT", ttft))
        up = started(root, "service", Path(model), num_workers=1)
        try:
            ttfc, totals, one_tokens, job_ids, walls = service_ttfc(
                up.url, up.headers, model, texts, args.max_tokens)
        finally:
            stop_service(up)
        stamps = job_stamps(root / "service" / "batchinfer.db", job_ids)
        inside = [row[3] - row[2] for row in stamps]
    print(summary("service TTFC (first chunk with text)", ttfc))
    print(summary(f"service time to [DONE] ({args.max_tokens} tokens)", totals))
    print(summary("service 1-token request without stream", one_tokens))
    ratio = statistics.median(ttfc) / statistics.median(ttft)
    print(f"TTFC / TTFT (medians): {ratio:.2f} (target <= 1.20); the service adds "
          f"{1e3 * (statistics.median(ttfc) - statistics.median(ttft)):.1f} ms")
    print(summary("engine TTFT inside the service (claim to first token, job rows)", inside))
    added = [first - engine for first, engine in zip(ttfc, inside, strict=True)]
    print(summary("what the service adds per request (TTFC - claim to first token)", added))
    print(f"TTFC / TTFT inside the service (medians): "
          f"{statistics.median(ttfc) / statistics.median(inside):.2f}")
    print("where a streamed request's time goes (median per stage):")
    for name, seconds in stages(walls, stamps).items():
        print(f"  {name}: {1e3 * statistics.median(seconds):.1f} ms")
    print(f"TTFC / 1-token request without stream (medians): "
          f"{statistics.median(ttfc) / statistics.median(one_tokens):.2f}")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
