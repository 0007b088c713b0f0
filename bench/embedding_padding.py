"""Padding of embedding batches: a worker's pool of held jobs against one sort of them all.

The runner alone sorts every text by length before batching; a worker batches from the
jobs it holds (`BATCHINFER_EMBEDDING_WORKER_MAX_INFLIGHT`), refilled in file order as
batches leave, through the engine's own pool (`WaitingInputs`). Fewer jobs held spread each
batch over a wider band of lengths. This replays the batch choice over the bench's texts
(no model runs: only the tokenizer and the pool) and prints, per number held, the padding
beside the full sort's and the batches' attention work (rows x width^2) against it:

    .venv/bin/python -m bench.embedding_padding --num-texts 10000 --held 2048 4096 8192
"""

from __future__ import annotations

import argparse

from bench.embeddings_throughput import make_texts
from workers.engine.embedding_pool import WaitingInputs
from workers.engine.embedding_runner import EmbeddingRunner, EncodedInput, batch_budget


def batch_costs(batches: list[list[EncodedInput]], num_tokens: int) -> tuple[float, int]:
    """(padded tokens over real ones − 1, Σ rows × width²) of these batches."""
    widths = [max(len(e.token_ids) for e in batch) for batch in batches]
    padded = sum(len(batch) * width for batch, width in zip(batches, widths, strict=True))
    attention = sum(len(batch) * width**2 for batch, width in zip(batches, widths, strict=True))
    return padded / num_tokens - 1, attention


def pool_batches(runner: EmbeddingRunner, encoded: list[EncodedInput],
                 held: int) -> list[list[EncodedInput]]:
    """The batches a worker holding `held` jobs of one input each would run."""
    pool, arrived = WaitingInputs(), 0
    batches: list[list[EncodedInput]] = []
    while True:
        while arrived < len(encoded) and len(pool) < held:
            pool.add(0, encoded[arrived], None)
            arrived += 1
        if not len(pool):
            return batches
        budget = batch_budget(pool.num_tokens, runner.max_num_batched_tokens, runner.streams)
        batches.append([w.encoded for w in pool.take_batch(budget, runner.max_batch_size)])


def main() -> None:
    """Parse options, replay both ways of batching, print the table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-minilm-l6-v2")
    parser.add_argument("--num-texts", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held", type=int, nargs="+", default=[2048, 4096, 8192])
    args = parser.parse_args()
    runner = EmbeddingRunner(args.model)
    encoded = runner.encode(make_texts(args.num_texts, args.seed))
    num_tokens = sum(len(e.token_ids) for e in encoded)
    sorted_padding, sorted_attention = batch_costs(runner.batches(encoded), num_tokens)
    print(f"{args.num_texts} texts, {num_tokens} tokens, {runner.streams} streams")
    print(f"{'batching':<22} {'padding':>8} {'attention / full sort':>22}")
    print(f"{'full sort (runner)':<22} {sorted_padding:>8.2%} {1:>22.4f}")
    for held in args.held:
        padding, attention = batch_costs(pool_batches(runner, encoded, held), num_tokens)
        print(f"{f'worker, {held} held':<22} {padding:>8.2%} "
              f"{attention / sorted_attention:>22.4f}")


if __name__ == "__main__":
    main()
