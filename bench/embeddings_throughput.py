"""Embedding throughput: this project's embedding runner beside sentence-transformers.

One invocation embeds the same texts with each contender, same model, same device, same
process, and prints texts/s and tokens/s with the ratio:

  runner     workers.engine.embedding_runner (length-sorted, token-budget batches)
  st         sentence-transformers' `encode` (its own length sort, fixed batch size)

The texts are synthetic sentences of mixed length (seeded), from a few words to past the
model's 256-token limit, the shape of a real corpus. Both contenders are warmed up first,
and each is timed --repeats times (the best run counts, as the neighbours' load on a
shared machine only ever slows a run down). The two outputs are also compared (cosine).

    .venv/bin/python -m bench.embeddings_throughput                   # CPU, 2,000 texts
    .venv/bin/python -m bench.embeddings_throughput --num-texts 20000 --device cuda
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    parser.add_argument("--max-num-batched-tokens", type=int, default=16_384,
                        help="the runner's token budget per batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    texts = make_texts(args.num_texts, args.seed)
    runner = EmbeddingRunner(args.model, device=args.device,
                             max_num_batched_tokens=args.max_num_batched_tokens)
    st = SentenceTransformer(str(runner.model_dir), device=args.device)
    num_tokens = sum(len(e.token_ids) for e in runner.encode(texts))
    print(f"{args.num_texts} texts, {num_tokens} tokens (truncated at {runner.max_model_len}), "
          f"{args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.2f}")

    warm = texts[: min(64, len(texts))]
    runner.embed(warm)
    st.encode(warm, batch_size=args.batch_size)

    timings = [
        Timing("runner", best_of(args.repeats, lambda: runner.embed(texts)), len(texts),
               num_tokens),
        Timing("st", best_of(args.repeats, lambda: st.encode(texts, batch_size=args.batch_size,
                                                             convert_to_numpy=True)),
               len(texts), num_tokens),
    ]
    for timing in timings:
        print(timing.line())
    print(f"runner / st: {timings[1].seconds / timings[0].seconds:.2f}x")
    ours = torch.stack([o.embedding for o in runner.embed(texts)])
    theirs = torch.as_tensor(st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True))
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).min().item()
    print(f"lowest cosine between the two: {cosine:.6f}")


if __name__ == "__main__":
    main()
