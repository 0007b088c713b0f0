"""The online step cost model: recovers a linear law, stays non-negative, follows change."""

from __future__ import annotations

import random

import pytest

from workers.engine.step_cost import StepCostModel, StepShape


def law(shape: StepShape) -> float:
    """A machine whose steps cost 2 ms + 50 us/token + 0.2 us/KV token + 30 us/sequence."""
    return 0.002 + 50e-6 * shape.num_tokens + 0.2e-6 * shape.num_kv_tokens + 30e-6 * shape.num_seqs


def random_shape(rng: random.Random) -> StepShape:
    num_seqs = rng.randint(1, 256)
    num_tokens = num_seqs + rng.choice([0, 0, rng.randint(1, 2048)])
    return StepShape(num_tokens, num_tokens + num_seqs * rng.randint(10, 2000), num_seqs)


def test_recovers_the_coefficients_of_a_linear_machine() -> None:
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(200):
        shape = random_shape(rng)
        model.observe(shape, law(shape))
    a, b, c, d = model.coefficients()
    assert a == pytest.approx(0.002, rel=0.05)
    assert b == pytest.approx(50e-6, rel=0.05)
    assert c == pytest.approx(0.2e-6, rel=0.05)
    assert d == pytest.approx(30e-6, rel=0.05)
    probe = StepShape(300, 60_000, 40)
    assert model.predict(probe) == pytest.approx(law(probe), rel=0.02)


def test_is_fitted_only_after_enough_steps() -> None:
    model = StepCostModel(min_steps=8)
    for i in range(7):
        model.observe(StepShape(10 + i, 100, 4), 0.01)
        assert not model.is_fitted
    model.observe(StepShape(20, 100, 4), 0.01)
    assert model.is_fitted


def test_coefficients_never_go_negative() -> None:
    """Decode-only steps (tokens == seqs) with a time that falls as batches widen would
    give some feature a negative weight; it is dropped instead."""
    model = StepCostModel()
    for n in range(1, 60):
        model.observe(StepShape(n, 50 * n, n), 0.05 - 0.0002 * n)
    assert all(c >= 0 for c in model.coefficients())
    assert model.predict(StepShape(200, 10_000, 200)) >= 0


def test_follows_a_machine_that_slows_down() -> None:
    """Old steps fade: after the machine becomes 3x slower the fit follows it."""
    rng = random.Random(1)
    model = StepCostModel(forgetting=0.98)
    for _ in range(200):
        shape = random_shape(rng)
        model.observe(shape, law(shape))
    for _ in range(400):
        shape = random_shape(rng)
        model.observe(shape, 3 * law(shape))
    probe = StepShape(64, 20_000, 64)
    assert model.predict(probe) == pytest.approx(3 * law(probe), rel=0.05)


def test_max_new_tokens_within_inverts_the_prediction() -> None:
    rng = random.Random(2)
    model = StepCostModel()
    for _ in range(100):
        shape = random_shape(rng)
        model.observe(shape, law(shape))
    base = StepShape(4, 400, 4)
    n = model.max_new_tokens_within(base, 1000, 0.05)
    assert n > 1
    assert model.predict(base.plus(n, 1000 + n)) <= 0.05 + 1e-9
    assert model.predict(base.plus(n + 2, 1000 + n + 2)) > 0.05
    assert model.max_new_tokens_within(base, 1000, 0.001) == 0


def test_rejects_a_forgetting_factor_outside_0_1() -> None:
    with pytest.raises(ValueError, match="forgetting"):
        StepCostModel(forgetting=0.0)
