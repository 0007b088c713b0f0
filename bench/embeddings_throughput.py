"""Embedding throughput: this project's embedding runner beside sentence-transformers.

One invocation embeds the same texts with each contender, same model, same device, same
process, and prints texts/s and tokens/s with the ratio:

  runner     workers.engine.embedding_runner (length-sorted, token-budget batches)
  st         sentence-transformers' `encode` (its own length sort, fixed batch size)
  service    with --service: `batchinfer up --model <model>` on this machine, the texts as
             an OpenAI batch file (one line per text, endpoint /v1/embeddings), timed from
             batch creation to `completed` (upload and the worker's start excluded),
             beside the runner alone; `--service-rounds N` alternates the two N times
             and prints the median ratio

The texts are synthetic sentences of mixed length (seeded), from a few words to past the
model's 256-token limit, the shape of a real corpus. Both contenders are warmed up first,
and each is timed --repeats times (the best run counts, as the neighbours' load on a
shared machine only ever slows a run down). The two outputs are also compared (cosine).

    .venv/bin/python -m bench.embeddings_throughput                   # CPU, 2,000 texts
    .venv/bin/python -m bench.embeddings_throughput --num-texts 20000 --device cuda
    .venv/bin/python -m bench.embeddings_throughput --num-texts 10000 --service
    .venv/bin/python -m bench.embeddings_throughput --num-texts 10000 --service --skip-st \
        --repeats 1 --service-rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cli.batch import POLL_INTERVAL_S, TERMINAL_STATUSES
from workers.engine.embedding_runner import EmbeddingRunner

WORDS = (
    "batch inference queue worker model token vector cache partition offset broker result "
    "embedding sentence corpus search retrieval ranking document query latency throughput "
    "the a of and to in is that for on with as by at from this it be are was"
).split()


@dataclass(slots=True)
class Timing:
    """One contender's best run."""

    name: str
    seconds: float
    num_texts: int
    num_tokens: int

    @property
    def texts_per_s(self) -> float:
        """Texts embedded per second."""
        return self.num_texts / self.seconds

    def line(self) -> str:
        """A printable summary."""
        return (f"{self.name:8s} {self.seconds:8.2f} s  {self.texts_per_s:9.1f} texts/s  "
                f"{self.num_tokens / self.seconds:10.0f} tokens/s")


def make_texts(num_texts: int, seed: int) -> list[str]:
    """Seeded sentences: most short (3-40 words), one in ten long (100-400 words)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num_texts):
        num_words = rng.randint(100, 400) if rng.random() < 0.1 else rng.randint(3, 40)
        texts.append(" ".join(rng.choice(WORDS) for _ in range(num_words)).capitalize() + ".")
    return texts


def best_of(repeats: int, run: Callable[[], object]) -> float:
    """The shortest of `repeats` timed calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    """Parse options, run both contenders, print the table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-minilm-l6-v2")
    parser.add_argument("--num-texts", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="sentence-transformers' encode batch size (its default: 32)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096,
                        help="the runner's token budget per batch")
    parser.add_argument("--streams", type=int, default=None,
                        help="the runner's batches run side by side (default: one "
                             "single-threaded stream per CPU thread; 1 on a GPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--service", action="store_true",
                        help="also run the texts as a batch through `batchinfer up`")
    parser.add_argument("--worker-max-inflight", type=int, default=None,
                        help="jobs the embedding worker holds at once "
                             "(BATCHINFER_EMBEDDING_WORKER_MAX_INFLIGHT; its default if unset)")
    parser.add_argument("--skip-st", action="store_true",
                        help="leave sentence-transformers out (to compare the service with "
                             "the runner alone in less time)")
    parser.add_argument("--service-rounds", type=int, default=1,
                        help="rounds of the runner alone then the service, each ratio "
                             "printed and their median: this host's speed drifts between "
                             "minutes, so one pair of runs says little")
    parser.add_argument("--texts-per-line", type=int, default=1,
                        help="texts in each batch line's `input` list (the service run)")
    parser.add_argument("--request-sizes", type=int, nargs="*", default=[],
                        help="also time single requests of these many texts (consecutive "
                             "slices of the corpus), median of 12 each, both contenders")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    texts = make_texts(args.num_texts, args.seed)
    runner = EmbeddingRunner(args.model, device=args.device,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             streams=args.streams)
    st = None if args.skip_st else SentenceTransformer(str(runner.model_dir),
                                                        device=args.device)
    num_tokens = sum(len(e.token_ids) for e in runner.encode(texts))
    print(f"{args.num_texts} texts, {num_tokens} tokens (truncated at {runner.max_model_len}), "
          f"{args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"runner: {runner.streams} stream(s) of {runner.max_num_batched_tokens} tokens, "
          f"{platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.2f}")

    warm = texts[: min(64, len(texts))]
    runner.embed(warm)
    timings = [Timing("runner", best_of(args.repeats, lambda: runner.embed(texts)), len(texts),
                      num_tokens)]
    print(timings[0].line())
    if st is not None:
        compare_with_st(st, runner, texts, timings[0], args)
    for size in args.request_sizes:
        print(request_latency(runner, st, texts, size, args.batch_size))
    if args.service:
        ratios = [service_round(runner, texts, num_tokens, args,
                                timings[0] if args.service_rounds == 1 else None)
                  for _ in range(args.service_rounds)]
        if len(ratios) > 1:
            print(f"service / runner over {len(ratios)} rounds: median "
                  f"{statistics.median(ratios):.2f} (" +
                  ", ".join(f"{r:.2f}" for r in ratios) + ")")


def request_latency(runner: EmbeddingRunner, st: Any, texts: list[str], size: int,
                    batch_size: int) -> str:
    """Median milliseconds to embed one request of `size` texts: what a caller of the
    synchronous endpoint waits for, where a few long texts among short ones decide how
    much the short ones pad."""
    requests = [texts[i * size:(i + 1) * size] for i in range(14)]
    contenders: dict[str, Callable[[list[str]], object]] = {"runner": runner.embed}
    if st is not None:
        contenders["st"] = lambda request: st.encode(request, batch_size=batch_size)
    medians = {}
    for name, embed in contenders.items():
        for request in requests[:2]:
            embed(request)
        seconds = []
        for request in requests[2:]:
            start = time.perf_counter()
            embed(request)
            seconds.append(time.perf_counter() - start)
        medians[name] = 1e3 * statistics.median(seconds)
    line = f"one request of {size:4d} texts: " + ", ".join(
        f"{name} {ms:7.1f} ms" for name, ms in medians.items())
    if "st" in medians:
        line += f"  (st / runner: {medians['st'] / medians['runner']:.2f}x)"
    return line


def service_round(runner: EmbeddingRunner, texts: list[str], num_tokens: int,
                  args: argparse.Namespace, runner_timing: Timing | None) -> float:
    """One round of the runner alone (timed again unless `runner_timing` is given) and
    then the service on the same texts; the service's fraction of the runner's speed."""
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    runner.embed(texts)
    if runner_timing is None:
        runner_timing = Timing("runner", time.perf_counter() - wall_start, len(texts),
                               num_tokens)
        print(runner_timing.line())
    print(cpu_line("runner", {"this process": time.process_time() - cpu_start}, len(texts)))
    seconds, spent = service_run(args.model, texts, args.worker_max_inflight,
                                 args.texts_per_line)
    service = Timing("service", seconds, len(texts), num_tokens)
    print(service.line())
    print(cpu_line("service", spent, len(texts)))
    ratio = runner_timing.seconds / service.seconds
    print(f"service / runner: {ratio:.2f} of the runner's throughput")
    return ratio


def compare_with_st(st: Any, runner: EmbeddingRunner, texts: list[str], ours: Timing,
                    args: argparse.Namespace) -> None:
    """sentence-transformers' `encode` on the same texts: its time, the ratio, the lowest
    cosine between the two's vectors."""
    st.encode(texts[:64], batch_size=args.batch_size)
    theirs = Timing("st", best_of(args.repeats, lambda: st.encode(
        texts, batch_size=args.batch_size, convert_to_numpy=True)), len(texts), ours.num_tokens)
    print(theirs.line())
    print(f"runner / st: {theirs.seconds / ours.seconds:.2f}x")
    mine = torch.stack([o.embedding for o in runner.embed(texts)])
    other = torch.as_tensor(st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True))
    cosine = torch.nn.functional.cosine_similarity(mine, other, dim=-1).min().item()
    print(f"lowest cosine between the two: {cosine:.6f}")


def service_run(model: str, texts: list[str], max_inflight: int | None = None,
                texts_per_line: int = 1) -> tuple[float, dict[str, float]]:
    """Seconds from creating a batch of `texts` (`texts_per_line` to a line) to its
    completion, on a `batchinfer up` started (and stopped) here with one worker for
    `model`, and the CPU seconds each of its processes spent meanwhile."""
    import httpx

    from bench.role_cpu import cpu_seconds_by_pid, cpu_seconds_by_role
    from bench.service_throughput import stop_service
    from scheduler.embedded_services import free_port
    from tests.utils.up_process import start_up

    with tempfile.TemporaryDirectory(prefix="bench-embeddings-") as tmp:
        up = start_up(Path(tmp) / "data", free_port(), num_workers=1,
                      log_path=Path(tmp) / "up.log",
                      args=["--model", model, "--served-model-name", "emb"],
                      extra_env={} if max_inflight is None else {
                          "BATCHINFER_EMBEDDING_WORKER_MAX_INFLIGHT": str(max_inflight)})
        try:
            lines = [json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/embeddings",
                                 "body": {"model": "emb", "input": group}})
                     for i, group in enumerate(_lines_of(texts, texts_per_line))]
            with httpx.Client(base_url=up.url, timeout=120, headers=up.headers) as client:
                uploaded = client.post("/v1/files", data={"purpose": "batch"}, files={
                    "file": ("in.jsonl", ("\n".join(lines) + "\n").encode(),
                             "application/jsonl")}).raise_for_status().json()
                # Answered once the worker has loaded its model and joined its group: the
                # runner alone is timed warm, so is the service.
                client.post("/v1/embeddings", json={"model": "emb", "input": "warm-up"}
                            ).raise_for_status()
                before = cpu_seconds_by_pid(up)
                start = time.perf_counter()
                batch = client.post("/v1/batches", json={
                    "input_file_id": uploaded["id"], "endpoint": "/v1/embeddings",
                    "completion_window": "24h"}).raise_for_status().json()
                # Followed as `batchinfer batch run` follows it: each look is held open by
                # the service until the batch ends or POLL_INTERVAL_S passes, so its end is
                # seen within moments. Looks cost the API's loop and a database read on the
                # cores the embedding streams need (at five a second ~1.5% of the machine
                # for the whole batch), and a plain poll each second saw the end 0.5 s late
                # on average, ~0.8% of the batch's time.
                while batch["status"] not in TERMINAL_STATUSES:
                    batch = client.get(f"/v1/batches/{batch['id']}", params={
                        "wait": POLL_INTERVAL_S}).raise_for_status().json()
                seconds = time.perf_counter() - start
                spent = cpu_seconds_by_role(before, cpu_seconds_by_pid(up))
                if batch["status"] != "completed" or batch["request_counts"]["failed"]:
                    raise RuntimeError(f"the batch ended {batch['status']}: {batch}")
                print("  batch phases: " + ", ".join(
                    f"{name} {batch[end] - batch[begin]:.1f} s" for name, begin, end in (
                        ("validating", "created_at", "in_progress_at"),
                        ("in progress", "in_progress_at", "finalizing_at"),
                        ("finalizing", "finalizing_at", "completed_at"))))
                return seconds, spent
        finally:
            stop_service(up)


def _lines_of(texts: list[str], texts_per_line: int) -> list[str | list[str]]:
    """Each line's `input`: a lone text, or a list of up to `texts_per_line` texts."""
    if texts_per_line == 1:
        return list(texts)
    return [texts[i:i + texts_per_line] for i in range(0, len(texts), texts_per_line)]


def cpu_line(title: str, spent: dict[str, float], num_texts: int) -> str:
    """CPU milliseconds per text, by process."""
    parts = ", ".join(f"{role} {1e3 * s / num_texts:.2f}"
                      for role, s in sorted(spent.items(), key=lambda kv: -kv[1]))
    return (f"  {title} CPU ms per text: {parts} "
            f"(total {1e3 * sum(spent.values()) / num_texts:.2f})")


if __name__ == "__main__":
    main()
