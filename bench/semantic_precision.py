"""How often the semantic cache serves a right answer, how often a wrong one, and what it costs.

Quality, on the labelled pairs (`tests/data/semantic_pairs.jsonl`; each pair is a prompt
asked after another was answered, embedded and verified exactly as a worker does it):
- at the chosen setting (`--max-error`, default 0.01): per split (calibration, held-out)
  and kind (questions, conversations), the share of should-hit pairs served and of traps
  given the wrong answer, and per category;
- as curves: the same two shares over max_error, and over raw cosine thresholds
  (`cache.threshold`, where the structured checks still apply).

Cost, at `--entries` (100,000) entries in one scope of a real Redis (exact scan backend,
its float16 pass as in a worker; a `redis-server` started here): the scope is filled
with random unit vectors (each with a probe, as entries are stored) plus the answered
prompts of the pairs, then each should-hit question is looked up through the worker's
own `SemanticLookup.find`, one job per call, timing wall and CPU per job, and apart:
the embedding of the prompt, and the verifier on a candidate.

    .venv/bin/python -m bench.semantic_precision [--max-error 0.01 --entries 100000]
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections import defaultdict

import numpy as np
import redis

from bench.semantic_eval import ScoredPair, read_pairs, score_pairs
from bench.semantic_search import percentile_ms, redis_url, unit_rows
from core.messages import JobMessage
from storage.cache_policy import CachePolicy
from storage.semantic_cache import SemanticEntry, semantic_namespace
from storage.semantic_exact import ExactSemanticCache
from workers.engine.config import DEFAULT_MODELS_DIR
from workers.inference.semantic_checks import salient
from workers.inference.semantic_lookup import SemanticLookup
from workers.inference.semantic_segments import PromptSegments, SegmentVectors, segments_of
from workers.inference.semantic_verifier import Probe, accepts, features_of, load_calibration

CURVE_MAX_ERRORS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
CURVE_THRESHOLDS = (0.85, 0.9, 0.93, 0.95, 0.97, 0.99)
SPLITS = ("calibration", "heldout")


def rates(scored: list[ScoredPair], policy: CachePolicy) -> tuple[str, str]:
    """(should-hit served, traps wrongly served) as 'pct (k/n)'."""
    calibration = load_calibration()
    hits = [s.served(policy, calibration) for s in scored if s.should_hit]
    wrong = [s.served(policy, calibration) for s in scored if not s.should_hit]
    return _share(hits), _share(wrong)


def _share(flags: list[bool]) -> str:
    return f"{100 * np.mean(flags):.1f}% ({sum(flags)}/{len(flags)})" if flags else "-"


def report_quality(scored: list[ScoredPair], max_error: float) -> None:
    """The tables of the module docstring."""
    policy = CachePolicy(mode="semantic", max_error=max_error)
    print(f"\n## At max_error {max_error}\n")  # noqa: T201
    print("| split | kind | should-hit served | traps given a wrong answer |")  # noqa: T201
    print("|---|---|---|---|")  # noqa: T201
    for split in SPLITS:
        for kind in ("question", "conversation"):
            group = [s for s in scored if s.pair["split"] == split and s.kind == kind]
            print(f"| {split} | {kind} | {' | '.join(rates(group, policy))} |")  # noqa: T201
    print("\n| category | served, calibration | served, held-out |")  # noqa: T201
    print("|---|---|---|")  # noqa: T201
    by_category: dict[str, list[ScoredPair]] = defaultdict(list)
    for s in scored:
        by_category[s.pair["category"]].append(s)
    calibration = load_calibration()
    for category, group in sorted(by_category.items()):
        cells = [_share([s.served(policy, calibration) for s in group
                         if s.pair["split"] == split]) for split in SPLITS]
        label = "hit" if group[0].should_hit else "trap"
        print(f"| {category} ({label}) | {cells[0]} | {cells[1]} |")  # noqa: T201
    print("\n## Curves (held-out split; served should-hit / wrong on traps)\n")  # noqa: T201
    held_out = [s for s in scored if s.pair["split"] == "heldout"]
    for name, policies in (
            ("max_error", [CachePolicy(mode="semantic", max_error=e) for e in CURVE_MAX_ERRORS]),
            ("threshold", [CachePolicy(mode="semantic", threshold=t) for t in CURVE_THRESHOLDS])):
        print(f"| {name} | questions | conversations |")  # noqa: T201
        print("|---|---|---|")  # noqa: T201
        for p in policies:
            cells = [" / ".join(rates([s for s in held_out if s.kind == kind], p))
                     for kind in ("question", "conversation")]
            value = p.threshold if name == "threshold" else p.max_error
            print(f"| {value} | {cells[0]} | {cells[1]} |")  # noqa: T201
        print()  # noqa: T201


def _job(text: str) -> JobMessage:
    body = {"prompt": text, "max_tokens": 16, "temperature": 0,
            "cache": {"mode": "semantic"}}
    return JobMessage(job_id=uuid.uuid4().hex, tenant_id="bench", priority="normal",
                      model="bench-model", kind="text_completion", body=body)


def report_cost(scored: list[ScoredPair], entries: int) -> None:
    """Lookup latency and CPU per job at `entries` entries in one scope."""
    rng = np.random.default_rng(0)
    questions = [s.pair for s in scored if s.kind == "question" and s.should_hit]
    answered = sorted({p["b"]["prompt"] for p in questions})
    asked = [p["a"]["prompt"] for p in questions]
    namespace = semantic_namespace(tenant_id="bench", model="bench-model", revision=None,
                                   body=_job("x").body)
    with redis_url("") as url:
        client = redis.Redis.from_url(url)
        cache = ExactSemanticCache(client, prefix=f"b{uuid.uuid4().hex[:6]}",
                                   max_entries=entries + len(answered) + 128)
        keys = unit_rows(rng, entries)
        for first in range(0, entries, 1000):
            batch = []
            for i in range(first, min(first + 1000, entries)):
                probe = Probe.of(PromptSegments(f"random prompt {i}", ""),
                                 SegmentVectors(keys[i], keys[i], False))
                batch.append(SemanticEntry(namespace, f"r{i}", f"random prompt {i}", keys[i],
                                           {"answer": {"text": "x"}, "probe": probe.to_json()},
                                           3600))
            cache.add_many(batch)
        lookup = SemanticLookup(cache, models_dir=DEFAULT_MODELS_DIR, revision=None,
                                default_ttl_s=3600)
        jobs = [_job(text) for text in answered]
        lookup.find(jobs)  # misses: embedded, then remembered as answered
        lookup.remember_many([(j, {"text": f"answer to {j.job_id}"}) for j in jobs])
        lookup.find([_job(asked[0])])  # warm: the mirror holds the scope
        embed_wall, embed_cpu, match_wall, match_cpu, num_hits = [], [], [], [], 0
        for text in asked:
            job = _job(text)
            start, start_cpu = time.perf_counter(), time.process_time()
            embedded = lookup.embed([job])
            middle, middle_cpu = time.perf_counter(), time.process_time()
            num_hits += len(lookup.match(embedded))
            embed_wall.append(middle - start)
            embed_cpu.append(middle_cpu - start_cpu)
            match_wall.append(time.perf_counter() - middle)
            match_cpu.append(time.process_time() - middle_cpu)
            lookup.forget(job.job_id)
        client.close()
    verify_us = _verifier_cost(scored)
    print(f"## Cost at {entries:,} entries in one scope (+{len(answered)} real), "  # noqa: T201
          f"exact scan ({'float16' if cache.scorer.half else 'float32'} pass, exact "
          f"rescoring), one job per call, {len(asked)} jobs ({num_hits} hits)\n")
    for name, wall, cpu in (("lookup (search + verify)", match_wall, match_cpu),
                            ("embedding the prompt (segments)", embed_wall, embed_cpu)):
        print(f"- {name} per job: wall p50 {percentile_ms(wall, 50):.2f} ms, "  # noqa: T201
              f"p99 {percentile_ms(wall, 99):.2f} ms; CPU p50 {percentile_ms(cpu, 50):.2f} ms, "
              f"mean {1000 * float(np.mean(cpu)):.2f} ms")
    print(f"- verifier on one candidate (checks, features, decision): {verify_us:.0f} us")  # noqa: T201


def _verifier_cost(scored: list[ScoredPair]) -> float:
    """Mean microseconds the verifier spends on one candidate, as `SemanticLookup` does it:
    read the probe from its JSON, compute the features (checks included), decide."""
    rng = np.random.default_rng(1)
    policy, calibration = CachePolicy(mode="semantic"), load_calibration()
    cases = []
    for s in scored:
        a, b = segments_of(s.pair["a"]), segments_of(s.pair["b"])
        va, vb = (SegmentVectors(r[0], r[1], x.has_context)
                  for r, x in ((unit_rows(rng, 2), a), (unit_rows(rng, 2), b)))
        cases.append((a, va, Probe.of(b, vb).to_json()))
    salient.cache_clear()  # each text parsed once in the timing, as a fresh worker would
    start = time.perf_counter()
    for a, va, raw in cases:
        accepts(policy, features_of(a, va, Probe.from_json(raw)), 0.97, calibration)
    return (time.perf_counter() - start) / len(cases) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-error", type=float, default=0.01)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--no-cost", action="store_true", help="quality tables only")
    args = parser.parse_args()
    from workers.engine.embedding_runner import EmbeddingRunner

    print(f"# semantic_precision: load average {os.getloadavg()[0]:.2f} at the start")  # noqa: T201
    scored = score_pairs(read_pairs(), EmbeddingRunner("all-minilm-l6-v2"))
    report_quality(scored, args.max_error)
    if not args.no_cost:
        report_cost(scored, args.entries)
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")  # noqa: T201


if __name__ == "__main__":
    main()
