"""Schema-constrained generation on SmolLM2: validity, and what the grammar costs.

1. Validity: 200 chat requests over the 10 schemas of bench/structured_schemas.py (20 per
   schema, sampled at temperature 0.7 with distinct seeds); every output must parse and
   validate with `jsonschema`, including those the token budget closed (a model looping
   in a value is given the shortest way out before max_tokens: `finish_reason: length`,
   whole JSON). Those are counted apart, as are outputs cut unparsable (a budget too small
   for any way out).
2. Cost: output tokens/s at batch 64, constrained against unconstrained, side by side in
   one process, alternating runs. The unconstrained run generates exactly the token
   counts the constrained one did (ignore_eos, max_tokens per request), so both do the
   same model work and only the grammar differs.

Run: `python bench/structured_output.py [--model smollm2-135m-instruct] [--rounds 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.structured_schemas import PROMPTS, SCHEMAS  # noqa: E402
from workers.engine import LLM, SamplingParams  # noqa: E402

BATCH = 64
MAX_TOKENS = 256


def _requests(n: int) -> tuple[list[list[dict[str, str]]], list[SamplingParams], list[int]]:
    prompts, params, schema_ids = [], [], []
    for i in range(n):
        k = i % len(SCHEMAS)
        system = ("Answer with a JSON document that follows this schema: "
                  + json.dumps(SCHEMAS[k]))
        prompts.append([{"role": "system", "content": system},
                        {"role": "user", "content": PROMPTS[k]}])
        params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=i,
                                     json_schema=json.dumps(SCHEMAS[k])))
        schema_ids.append(k)
    return prompts, params, schema_ids


def validity(llm: LLM, n: int) -> None:
    """Generate n constrained outputs and check each one."""
    prompts, params, schema_ids = _requests(n)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    valid = closed = cut = 0
    failures: list[str] = []
    for out, k in zip(outputs, schema_ids, strict=True):
        try:
            document = json.loads(out.text)
        except json.JSONDecodeError as e:
            if out.finish_reason == "length":
                cut += 1
            else:
                failures.append(f"schema {k + 1}: {e}: {out.text[:200]!r}")
            continue
        try:
            jsonschema.validate(document, SCHEMAS[k])
        except jsonschema.ValidationError as e:
            failures.append(f"schema {k + 1}: {e.message}: {out.text[:200]!r}")
            continue
        valid += 1
        closed += out.finish_reason == "length"
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"validity: {valid}/{n} valid ({closed} of them closed at max_tokens={MAX_TOKENS}), "  # noqa: T201
          f"{cut} cut unparsable, {len(failures)} invalid; {tokens} tokens in {elapsed:.1f} s")
    for failure in failures[:5]:
        print("  INVALID", failure)  # noqa: T201


def throughput(llm: LLM, rounds: int, batch: int) -> None:
    """Constrained vs unconstrained output tokens/s at `batch`, alternating."""
    prompts, params, _ = _requests(batch)
    constrained_rates, free_rates = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - start
        lengths = [len(o.token_ids) for o in outputs]
        constrained_rates.append(sum(lengths) / elapsed)
        free = [SamplingParams(max_tokens=max(1, n), temperature=0.7, seed=i, ignore_eos=True)
                for i, n in enumerate(lengths)]
        start = time.perf_counter()
        free_outputs = llm.generate(prompts, free)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - start
        free_rates.append(sum(len(o.token_ids) for o in free_outputs) / elapsed)
    c, f = statistics.median(constrained_rates), statistics.median(free_rates)
    print(f"batch {batch}: constrained {c:.0f} tok/s, unconstrained {f:.0f} tok/s, "  # noqa: T201
          f"loss {100 * (1 - c / f):.1f}% (median of {rounds}; rounds "
          f"{[round(r) for r in constrained_rates]} vs {[round(r) for r in free_rates]})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-outputs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=BATCH)
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()}")  # noqa: T201
    llm = LLM(args.model, device=args.device, max_num_seqs=args.batch)
    if args.num_outputs:
        validity(llm, args.num_outputs)
    throughput(llm, args.rounds, args.batch)
    print(f"load after: {os.getloadavg()}")  # noqa: T201


if __name__ == "__main__":
    main()
