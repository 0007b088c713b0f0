"""Every served family's engine throughput beside Llama's, per FLOP, in one invocation.

Each family is a random-weight model at SmolLM2-135M's shape (bench/family_models.py);
mixtures have 8 experts of half the MLP width with 2 per token, so a token's active
weights match the dense families'. Every family runs the same random token-id workload
(greedy, ignoring EOS) through `LLM.generate`, as `bench.engine_throughput` does, in
`--rounds` rounds, each round visiting every family once in a rotated order, so a
neighbour's load on a shared machine falls on all of them alike. Each family's best round
counts: the fastest by wall time and, apart, the one that took the least CPU time.

Per family it prints output tokens per wall second and per CPU second, the FLOPs a token
costs (2 per active weight of the projections, experts and LM head; attention over the
context is left out: it is the same work in every family but the windowed ones, which do
less), and throughput per FLOP relative to Llama's (1.00 is Llama; the issue's bar is no
family below 0.85).

    .venv/bin/python -m bench.family_throughput [--families llama gemma3 ...] [--rounds 2]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from bench.engine_throughput import Result, machine, make_workload, run_engine
from bench.family_models import FAMILY_CONFIGS, SHAPE, random_family_model


def active_flops_per_token(config: Any) -> int:
    """2 x the weights one token's forward pass multiplies by (attention scores aside)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = hidden * head_dim * (2 * config.num_attention_heads
                                     + 2 * config.num_key_value_heads)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        mlp = 3 * hidden * width * config.num_experts_per_tok + hidden * experts  # + router
    else:
        mlp = 3 * hidden * config.intermediate_size
    layers = config.num_hidden_layers * (attention + mlp)
    return 2 * (layers + config.vocab_size * hidden)


def parse_args() -> argparse.Namespace:
    """Command-line options (the workload's defaults are `bench.engine_throughput`'s)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILY_CONFIGS),
                        default=list(FAMILY_CONFIGS), help="llama is always added")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 512],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 256],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if "llama" not in args.families:
        args.families.insert(0, "llama")
    # What run_engine reads beyond the workload.
    args.device, args.attention_backend, args.enforce_eager = "auto", "auto", False
    args.max_num_seqs, args.kv_cache_gib, args.workload, args.roofline = 256, None, "", False
    args.kv_cache_dtype = "auto"
    return args


def main() -> None:
    """Run every family in rotated rounds and print throughput per FLOP against Llama's."""
    logging.basicConfig(level=logging.WARNING)
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = make_workload(args, SHAPE["vocab_size"])
    print(f"{args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, "
          f"ignore_eos, greedy, dtype {args.dtype}; {machine()}")
    runs: dict[str, list[Result]] = {family: [] for family in args.families}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {family: random_family_model(family, Path(tmp)) for family in args.families}
        for round_index in range(args.rounds):
            shift = round_index % len(args.families)
            for family in args.families[shift:] + args.families[:shift]:
                result = run_engine(dirs[family], work, args)
                result.name = f"{family} (round {round_index + 1})"
                print(result.line(), flush=True)
                runs[family].append(result)
        flops = {family: active_flops_per_token(AutoConfig.from_pretrained(dirs[family]))
                 for family in args.families}  # fmt: skip
    def rate(family: str) -> float:  # output tokens per wall second, best round
        return max(r.num_output_tokens / r.seconds for r in runs[family])

    def cpu_rate(family: str) -> float:  # output tokens per CPU second, best round
        return max(r.num_output_tokens / r.cpu_seconds for r in runs[family])

    print("\nper family, best round: output tokens/s (per CPU second), GFLOP per token, "
          "throughput per FLOP vs llama (per CPU second), load")
    for family in args.families:
        per_flop = rate(family) * flops[family] / (rate("llama") * flops["llama"])
        per_cpu_flop = cpu_rate(family) * flops[family] / (cpu_rate("llama") * flops["llama"])
        loads = [r.load for r in runs[family]]
        print(f"  {family:<15} {rate(family):8.1f} ({cpu_rate(family):7.1f})  "
              f"{flops[family] / 1e9:.3f}  {per_flop:.2f} ({per_cpu_flop:.2f})  "
              f"load {min(loads):.1f}-{max(loads):.1f}")

if __name__ == "__main__":
    main()
