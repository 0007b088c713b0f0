"""Fits the semantic-cache verifier's calibration on the labelled pairs' calibration split.

Writes `workers/inference/semantic_calibration.json`: the score's two penalties (picked
from a small grid: most should-hit pairs served at max_error 0.01 on the calibration
split, the smaller penalty on a tie) and, per kind (question, conversation), a threshold
for each error bound in `BOUNDS`, set split-conformally on that kind's trap pairs (see
`workers.inference.semantic_verifier`). The held-out split is never read here.

    .venv/bin/python -m bench.semantic_calibrate
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from bench.semantic_eval import ScoredPair, read_pairs, score_pairs
from storage.cache_policy import CachePolicy
from workers.inference.semantic_verifier import (
    CALIBRATION_PATH,
    KINDS,
    Calibration,
    conformal_threshold,
)

BOUNDS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
OVERLAP_PENALTIES = (0.0, 1.0, 2.0)
CONTEXT_PENALTIES = (1.0, 2.0, 4.0)
FIT_BOUND = 0.01


def fit(scored: list[ScoredPair], overlap_penalty: float, context_penalty: float) -> Calibration:
    """Thresholds per kind and bound for the given penalties."""
    probe = Calibration(overlap_penalty, context_penalty, {})
    kind_to_bounds = {}
    for kind in KINDS:
        traps = [probe.score(s.features) for s in scored
                 if s.kind == kind and not s.should_hit and s.same_scope]
        kind_to_bounds[kind] = [(b, conformal_threshold(traps, b)) for b in BOUNDS]
    return Calibration(overlap_penalty, context_penalty, kind_to_bounds)


def hit_rate(scored: list[ScoredPair], calibration: Calibration) -> float:
    """Share of should-hit pairs served at FIT_BOUND, over both kinds equally."""
    policy = CachePolicy(mode="semantic", max_error=FIT_BOUND)
    rates = []
    for kind in KINDS:
        hits = [s.served(policy, calibration) for s in scored if s.kind == kind and s.should_hit]
        rates.append(float(np.mean(hits)) if hits else 0.0)
    return float(np.mean(rates))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print, do not write")
    args = parser.parse_args()
    from workers.engine.embedding_runner import EmbeddingRunner

    pairs = [p for p in read_pairs() if p["split"] == "calibration"]
    scored = score_pairs(pairs, EmbeddingRunner("all-minilm-l6-v2"))
    best: tuple[float, Calibration] | None = None
    for overlap_penalty in OVERLAP_PENALTIES:
        for context_penalty in CONTEXT_PENALTIES:
            calibration = fit(scored, overlap_penalty, context_penalty)
            rate = hit_rate(scored, calibration)
            print(f"overlap {overlap_penalty} context {context_penalty}: "  # noqa: T201
                  f"{rate:.3f} of should-hit pairs served at max_error {FIT_BOUND}")
            if best is None or rate > best[0] + 1e-9:
                best = (rate, calibration)
    assert best is not None
    text = json_text(best[1])
    print(text)  # noqa: T201
    if not args.dry_run:
        CALIBRATION_PATH.write_text(text, encoding="utf-8")
        print(f"written to {CALIBRATION_PATH}")  # noqa: T201


def json_text(calibration: Calibration) -> str:
    """The calibration as the JSON file holds it."""
    raw = calibration.to_json()
    raw["fitted_on"] = "tests/data/semantic_pairs.jsonl, calibration split"
    return json.dumps(raw, indent=1) + "\n"


if __name__ == "__main__":
    main()
