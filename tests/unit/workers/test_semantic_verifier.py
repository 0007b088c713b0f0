"""The verifier of semantic-cache candidates: probes, calibrated thresholds, the decision."""

from __future__ import annotations

import numpy as np
import pytest

from storage.cache_policy import CachePolicy
from workers.inference.semantic_segments import PromptSegments, SegmentVectors
from workers.inference.semantic_verifier import (
    MIN_THRESHOLD,
    Calibration,
    CandidateFeatures,
    Probe,
    accepts,
    conformal_threshold,
    features_of,
    load_calibration,
)


def unit(*values: float) -> np.ndarray:
    vector = np.array(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


CALIBRATION = Calibration(0.0, 1.0, {
    "question": [(0.005, None), (0.01, 0.95), (0.05, 0.9)],
    "conversation": [(0.01, 0.97)],
})


def features(last: float, context: float = 1.0, kind: str = "question",
             failed: tuple[str, ...] = ()) -> CandidateFeatures:
    return CandidateFeatures(last, context, 0.5, failed, kind, True)


def test_a_probe_survives_its_json_form() -> None:
    vectors = SegmentVectors(unit(1, 2, 3), unit(3, 2, 1), True)
    probe = Probe.of(PromptSegments("last?", "user: before"), vectors)
    back = Probe.from_json(probe.to_json())
    assert (back.last, back.context, back.has_context) == ("last?", "user: before", True)
    assert np.allclose(back.last_vector, vectors.last, atol=1e-3)
    assert np.allclose(back.context_vector, vectors.context, atol=1e-3)
    with pytest.raises(ValueError, match="probe"):
        Probe.from_json({"last": "x"})


def test_max_error_picks_the_largest_calibrated_bound_within_it() -> None:
    assert CALIBRATION.threshold("question", 0.01) == 0.95
    assert CALIBRATION.threshold("question", 0.03) == 0.95
    assert CALIBRATION.threshold("question", 0.2) == 0.9
    assert CALIBRATION.threshold("question", 0.005) is None  # nothing certifies it
    assert CALIBRATION.threshold("question", 0.001) is None


def test_the_decision_under_max_error_and_under_a_raw_threshold() -> None:
    strict = CachePolicy(mode="semantic", max_error=0.01)
    assert accepts(strict, features(0.96), 0.96, CALIBRATION)
    assert not accepts(strict, features(0.94), 0.94, CALIBRATION)
    assert not accepts(strict, features(0.99, failed=("numbers",)), 0.99, CALIBRATION)
    # A conversation's threshold is its own, and its context counts.
    assert not accepts(strict, features(0.96, kind="conversation"), 0.96, CALIBRATION)
    assert not accepts(strict, features(1.0, 0.9, kind="conversation"), 0.98, CALIBRATION)
    assert accepts(strict, features(0.98, kind="conversation"), 0.98, CALIBRATION)
    assert not accepts(CachePolicy(mode="semantic", max_error=0.005), features(1.0), 1.0,
                       CALIBRATION)
    raw = CachePolicy(mode="semantic", threshold=0.9)
    assert accepts(raw, features(0.5), 0.91, CALIBRATION)  # the search keys' cosine decides
    assert not accepts(raw, features(0.99, failed=("names",)), 0.99, CALIBRATION)


def test_prompts_of_different_kinds_never_share() -> None:
    question = SegmentVectors(unit(1, 0, 0), unit(1, 0, 0), False)
    conversation = SegmentVectors(unit(1, 0, 0), unit(0, 1, 0), True)
    probe = Probe.of(PromptSegments("Why?", "user: Tell me about rain."), conversation)
    f = features_of(PromptSegments("Why?", ""), question, probe)
    assert not f.same_kind and f.kind == "question"
    assert CALIBRATION.score(f) == float("-inf")


def test_conformal_thresholds_leave_the_allowed_number_of_traps_above() -> None:
    traps = [0.5, 0.81, 0.9, 0.93, float("-inf")] + [0.6] * 95  # n = 100
    one_percent = conformal_threshold(traps, 0.01)  # (k + 1) / 101 <= 0.01: k = 0
    assert one_percent is not None and 0.93 < one_percent < 0.9301
    two_percent = conformal_threshold(traps, 0.02)  # k = 1: the best trap stays above
    assert two_percent is not None and 0.9 < two_percent <= 0.93
    assert conformal_threshold(traps, 0.005) is None  # 1 / 101 > 0.005
    assert conformal_threshold(traps, 0.5) == MIN_THRESHOLD


def test_the_shipped_calibration_is_complete() -> None:
    shipped = load_calibration()
    for kind in ("question", "conversation"):
        threshold = shipped.threshold(kind, 0.01)
        assert threshold is not None and MIN_THRESHOLD <= threshold < 1.0
