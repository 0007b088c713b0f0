"""A `high` job behind a full batch of `low` ones: its latency against an idle engine.

One invocation, one engine (as one worker holds it), four phases:

  idle     the high job alone (median of --repeats): completion time and time to first token
  solo     --num-low low jobs alone: their output tokens/s
  mixed    the same low jobs; once they all run, the high job arrives; its completion and
           TTFT, and the low jobs' tokens/s over the whole phase
  mixed-untargeted   the same with the latency classes off (no targets, no bounds), to
           show what they change

Targets (issue: priority that holds under a full batch): mixed completion <= 1.5x idle,
TTFT <= 2x, low tokens/s >= 85% of solo. Prompts are random token ids, greedy, EOS
ignored, so every job runs to its max_tokens.

    .venv/bin/python -m bench.priority_latency                     # SmolLM2-135M, CPU
    .venv/bin/python -m bench.priority_latency --model tiny        # random-weight tiny Llama
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from workers.engine import EngineConfig, LLMEngine, SamplingParams
from workers.engine.latency_classes import LatencyClasses

HIGH, LOW = 0, 2


@dataclass(slots=True)
class HighRun:
    """One high job's times, seconds from its arrival."""

    completion_s: float
    ttft_s: float


@dataclass(slots=True)
class LowRun:
    """The low jobs of one phase: output tokens over the phase's wall time."""

    num_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second."""
        return self.num_tokens / self.seconds


def save_tiny_model(path: Path) -> None:
    """A random-weight 4-layer Llama (hidden 256), no tokenizer: token ids only."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)


def prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random token ids clear of the special ones."""
    return [rng.randrange(3, vocab) for _ in range(length)]


def run_high(engine: LLMEngine, ids: list[int], max_tokens: int, tag: str) -> HighRun:
    """Add the high job and step until it finishes."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(tag, ids, params, priority=HIGH)
    first = None
    while True:
        for out in engine.step():
            if out.request_id != tag:
                continue
            if first is None:
                first = time.perf_counter() - start
            if out.finished:
                assert first is not None
                return HighRun(time.perf_counter() - start, first)


def add_lows(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> None:
    """Queue the low jobs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params, priority=LOW)


def run_phase(
    engine: LLMEngine,
    lows: list[list[int]],
    args: argparse.Namespace,
    high_ids: list[int] | None,
    tag: str,
) -> tuple[LowRun, HighRun | None]:
    """Run the low jobs to the end, with the high job arriving once they all run."""
    add_lows(engine, lows, args.low_tokens, tag)
    start = time.perf_counter()
    num_low_tokens = 0
    high: HighRun | None = None
    params = SamplingParams(temperature=0, max_tokens=args.high_tokens, ignore_eos=True)
    high_start = first = None
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        if high_ids is not None and high_start is None and step == args.arrive_after_steps:
            high_start = time.perf_counter()
            engine.add_request(f"{tag}-high", high_ids, params, priority=HIGH)
        for out in engine.step():
            if out.request_id == f"{tag}-high":
                assert high_start is not None
                if first is None:
                    first = time.perf_counter() - high_start
                if out.finished:
                    assert first is not None
                    high = HighRun(time.perf_counter() - high_start, first)
            else:
                num_low_tokens += len(out.delta_token_ids)
    return LowRun(num_low_tokens, time.perf_counter() - start), high


def main() -> None:
    """Run the four phases and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a model name or directory, or `tiny` (random-weight Llama)")
    parser.add_argument("--num-low", type=int, default=400)
    parser.add_argument("--low-tokens", type=int, default=64)
    parser.add_argument("--high-tokens", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--high-target-ms", type=float, default=40.0)
    parser.add_argument("--high-slowdown", type=float, default=1.0,
                        help="a step holding the high job at most this many times its own "
                             "cost (0: none)")
    parser.add_argument("--arrive-after-steps", type=int, default=8,
                        help="engine steps of the low batch before the high job arrives")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            model = tmp
            save_tiny_model(Path(tmp))
        engine = LLMEngine(
            EngineConfig(model=model, dtype=args.dtype, device=args.device,
                         skip_tokenizer_init=True,
                         step_time_targets={HIGH: args.high_target_ms / 1000},
                         step_slowdowns={HIGH: args.high_slowdown} if args.high_slowdown else {})
        )  # fmt: skip
        vocab = min(engine.vocab_size, 30_000)
        rng = random.Random(0)
        lows = [prompt(rng, args.prompt_len, vocab) for _ in range(args.num_low)]
        high_ids = prompt(rng, args.prompt_len, vocab)

        run_phase(engine, lows[:64], args, None, "warmup")
        idle = [
            run_high(engine, high_ids, args.high_tokens, f"idle{i}") for i in range(args.repeats)
        ]
        idle_completion = statistics.median(r.completion_s for r in idle)
        idle_ttft = statistics.median(r.ttft_s for r in idle)
        solo, _ = run_phase(engine, lows, args, None, "solo")
        mixed_low, mixed_high = run_phase(engine, lows, args, high_ids, "mixed")
        assert mixed_high is not None
        engine.scheduler.latency_classes = LatencyClasses()
        plain_low, plain_high = run_phase(engine, lows, args, high_ids, "plain")
        assert plain_high is not None

    load = os.getloadavg()
    print(f"model {args.model}, {args.num_low} low jobs x {args.low_tokens} tokens, "
          f"high job {args.high_tokens} tokens, prompts {args.prompt_len} tokens, "
          f"high target {args.high_target_ms:.0f} ms, slowdown {args.high_slowdown or 'none'}, "
          f"load {load[0]:.1f}/{load[1]:.1f}")
    print(f"idle   high: completion {idle_completion:.3f} s, TTFT {idle_ttft:.3f} s")
    print(f"solo   low: {solo.tokens_per_s:.0f} tok/s over {solo.seconds:.1f} s")
    phases = (("classes", mixed_low, mixed_high), ("no classes", plain_low, plain_high))
    for name, low, high in phases:
        print(f"mixed, {name}: high completion {high.completion_s:.3f} s "
              f"({high.completion_s / idle_completion:.2f}x idle), TTFT {high.ttft_s:.3f} s "
              f"({high.ttft_s / idle_ttft:.2f}x), low {low.tokens_per_s:.0f} tok/s "
              f"({low.tokens_per_s / solo.tokens_per_s:.0%} of solo)")
    a, b, c, d = engine.scheduler.cost_model.coefficients()
    print(f"cost model: {a * 1e3:.2f} ms/step + {b * 1e6:.1f} us/token + "
          f"{c * 1e9:.1f} ns/KV token + {d * 1e6:.1f} us/seq")  # fmt: skip


if __name__ == "__main__":
    main()
