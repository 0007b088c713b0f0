"""Latency classes through the real engine on a random-weight Llama (CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.engine.test_engine import greedy, make_engine, run_all
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import EngineConfig
from workers.engine.step_cost import StepShape


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-latency")
    save_tiny_llama(path, seed=7)
    return path


def test_engine_fits_its_cost_model_from_its_own_steps(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    for i in range(6):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8], greedy(8))
    run_all(engine)
    model = engine.scheduler.cost_model
    assert model.num_steps == 8  # one prefill step, seven decode steps
    assert model.is_fitted
    assert all(c >= 0 for c in model.coefficients())
    assert sum(model.coefficients()) > 0


@pytest.mark.parametrize("bound", [{"step_time_targets": {0: 1e-9}},
                                   {"step_slowdowns": {0: 1.0}}])
def test_low_requests_sit_out_while_a_high_one_runs_and_lose_nothing(
    model_dir: Path, bound: dict[str, dict[int, float]],
) -> None:
    """A target no step can meet, or a slowdown bound of 1 (a step no slower than the high
    request alone): low work sits out entirely while the high request runs, keeps its KV
    (no preemption), resumes after, and produces what it would alone."""
    alone = make_engine(model_dir)
    for i in range(4):
        alone.add_request(f"low{i}", [5 + i, 6, 7, 8], greedy(20), priority=2)
    expected = {rid: outs[-1].token_ids for rid, outs in run_all(alone).items()}

    engine = make_engine(model_dir, **bound)
    for i in range(4):
        engine.add_request(f"low{i}", [5 + i, 6, 7, 8], greedy(20), priority=2)
    for _ in range(10):  # enough steps to fit the cost model
        engine.step()
    cost_model = engine.scheduler.cost_model
    assert cost_model.is_fitted
    # Those steps all had four sequences and the tiny model's ~1 ms steps are mostly fixed
    # cost, so on a busy machine their noise can fit a constant: every addition priced at
    # 0 and let in under a slowdown bound of 1. Steps of other widths, as a serving engine
    # sees all the time, pin what a sequence costs.
    for _ in range(5):
        for width in range(1, 9):
            cost_model.observe(StepShape(width, 8 * width, width), 1e-3 * (1 + width))
    high_alone = StepShape(1, 4, 1)
    assert cost_model.predict(high_alone.plus(1, 12)) > cost_model.predict(high_alone)
    engine.add_request("high", [9, 10, 11], greedy(5), priority=0)
    high_done = False
    while not high_done:
        outputs = engine.step()
        assert [o.request_id for o in outputs] == ["high"]
        high_done = outputs[0].finished
    rest = run_all(engine)
    assert {rid: outs[-1].token_ids for rid, outs in rest.items()} == expected
    stats = engine.stats()
    assert stats.num_preemptions == 0
    assert stats.num_held_back_steps == 4 * 5  # four low sequences, five high steps


def test_step_time_targets_must_be_positive(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="step_time_targets"):
        EngineConfig(model=str(model_dir), step_time_targets={0: -1.0})
    with pytest.raises(ValueError, match=r"step_slowdowns\[0\] must be >= 1"):
        EngineConfig(model=str(model_dir), step_slowdowns={0: 0.5})
