"""Latency classes: urgent steps stay within their target, the rest sit out with their KV."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests.unit.engine.scheduler_driver import Requests, SchedulerDriver, make_scheduler
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_cost import StepCostModel, StepShape

HIGH, NORMAL, LOW = 0, 1, 2
TARGET = 0.0025  # seconds; a high decode alone costs ~2.1 ms under `law`


def law(shape: StepShape) -> float:
    """2 ms + 50 us/token + 0.2 us/KV token + 30 us/sequence."""
    return 0.002 + 50e-6 * shape.num_tokens + 0.2e-6 * shape.num_kv_tokens + 30e-6 * shape.num_seqs


def fitted_model(step_law: Callable[[StepShape], float] = law) -> StepCostModel:
    """A cost model that has watched a few hundred steps of a machine following
    `step_law` (`law` by default)."""
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(200):
        num_seqs = rng.randint(1, 64)
        num_tokens = num_seqs + rng.choice([0, rng.randint(1, 256)])
        shape = StepShape(num_tokens, num_tokens + num_seqs * rng.randint(4, 200), num_seqs)
        model.observe(shape, step_law(shape))
    return model


def scheduler(**kwargs: object) -> Scheduler:
    kwargs.setdefault("step_time_targets", {HIGH: TARGET, NORMAL: 4 * TARGET})
    kwargs.setdefault("cost_model", fitted_model())
    return make_scheduler(num_blocks=512, max_num_seqs=32, max_num_batched_tokens=256, **kwargs)  # type: ignore[arg-type]


def start_lows(sched: Scheduler, driver: SchedulerDriver, reqs: Requests, n: int) -> list[Sequence]:
    lows = [reqs.add(sched, [3 + i, 4, 5, 6], priority=LOW, max_tokens=60) for i in range(n)]
    driver.step()  # all prefilled in one step
    assert all(s.status is SequenceStatus.RUNNING and s.num_output_tokens == 1 for s in lows)
    return lows


def test_steps_holding_an_urgent_sequence_fit_its_target() -> None:
    sched = scheduler()
    driver = SchedulerDriver(sched)
    reqs = Requests()
    lows = start_lows(sched, driver, reqs, 20)
    high = reqs.add(sched, list(range(10, 26)), priority=HIGH, max_tokens=12)
    steps_with_high = 0
    while not high.is_finished:
        out, _ = driver.step()
        assert high in out.seqs  # the urgent sequence runs at every step
        steps_with_high += 1
        if out.num_scheduled_tokens[out.seqs.index(high)] == 1:  # a decode step
            assert sched.cost_model.predict(out.shape) <= TARGET
            assert law(out.shape) <= TARGET * 1.02
        # Some low sequences sat out, none was dropped or recomputed.
        assert out.num_held_back > 0
        assert len(out.seqs) < 1 + len(lows)
        for low in lows:
            assert low.status is SequenceStatus.RUNNING and low.block_table
            assert low.num_preemptions == 0
    assert steps_with_high == 12
    assert sched.num_preemptions == 0


def test_held_back_sequences_resume_with_their_kv_and_lose_nothing() -> None:
    sched = scheduler()
    driver = SchedulerDriver(sched)
    reqs = Requests()
    lows = start_lows(sched, driver, reqs, 20)
    tables = {low.request_id: list(low.block_table) for low in lows}
    high = reqs.add(sched, [40, 41], priority=HIGH, max_tokens=5)
    while not high.is_finished:
        driver.step()
    out, _ = driver.step()
    # Urgent work gone: the whole low batch runs again at once, from its own blocks
    # (the driver checks every position read is the sequence's own token).
    assert sorted(out.seqs, key=id) == sorted(lows, key=id)
    for low in lows:
        assert low.block_table[: len(tables[low.request_id])] == tables[low.request_id]
    driver.run()
    assert all(low.num_output_tokens == 60 for low in lows)
    assert sched.num_preemptions == 0


def test_no_urgent_work_means_nothing_is_held_back() -> None:
    """Low work alone runs as wide as budget and cap allow: no target of its own."""
    sched = scheduler()
    driver = SchedulerDriver(sched)
    reqs = Requests()
    lows = start_lows(sched, driver, reqs, 20)
    while sched.has_unfinished():
        out, _ = driver.step()
        assert out.num_held_back == 0
        assert sorted(out.seqs, key=id) == sorted(
            sched.running + [s for s in out.seqs if s.is_finished], key=id
        )
    assert all(low.num_output_tokens == 60 for low in lows)
    assert sched.num_held_back_steps == 0


def test_normal_work_gets_the_room_left_under_the_high_target() -> None:
    """Three classes: normal sequences fill what the high target leaves before low ones."""
    sched = scheduler()
    driver = SchedulerDriver(sched)
    reqs = Requests()
    lows = start_lows(sched, driver, reqs, 8)
    normals = [reqs.add(sched, [90 + i], priority=NORMAL, max_tokens=30) for i in range(3)]
    driver.step()
    high = reqs.add(sched, [70], priority=HIGH, max_tokens=10)
    driver.step()  # high's prefill
    out, _ = driver.step()
    assert high in out.seqs
    ran = set(out.seqs)
    if any(low in ran for low in lows):
        assert all(n in ran for n in normals)  # no low runs while a normal one sits out
    assert law(out.shape) <= TARGET * 1.02


def test_an_unfitted_cost_model_holds_nothing_back() -> None:
    """Before the engine has seen enough steps it cannot price one: no class is enforced."""
    sched = scheduler(cost_model=StepCostModel())
    driver = SchedulerDriver(sched)
    reqs = Requests()
    lows = start_lows(sched, driver, reqs, 20)
    reqs.add(sched, [40, 41], priority=HIGH, max_tokens=5)
    out, _ = driver.step()
    assert out.num_held_back == 0 and all(low in out.seqs for low in lows)


def test_without_targets_every_priority_runs_together() -> None:
    sched = scheduler(step_time_targets={})
    driver = SchedulerDriver(sched)
    reqs = Requests()
    lows = start_lows(sched, driver, reqs, 20)
    high = reqs.add(sched, [40, 41], priority=HIGH, max_tokens=5)
    out, _ = driver.step()
    assert high in out.seqs and all(low in out.seqs for low in lows)


def test_earliest_deadline_first_within_a_priority() -> None:
    sched = make_scheduler(max_num_seqs=1)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    none = reqs.add(sched, [3], priority=NORMAL, max_tokens=1)
    late = reqs.add(sched, [4], priority=NORMAL, deadline=2000.0, max_tokens=1)
    early = reqs.add(sched, [5], priority=NORMAL, deadline=1000.0, max_tokens=1)
    high = reqs.add(sched, [6], priority=HIGH, deadline=5000.0, max_tokens=1)
    order = [driver.step()[0].seqs[0] for _ in range(4)]
    assert order == [high, early, late, none]


def test_a_non_positive_target_is_refused() -> None:
    with pytest.raises(ValueError, match="step time target"):
        make_scheduler(step_time_targets={HIGH: 0.0})


@pytest.mark.parametrize("factor", [1.0, 1.3])
def test_a_slowdown_bound_holds_steps_to_a_multiple_of_the_urgent_work_alone(
    factor: float,
) -> None:
    """A target in seconds far above every step binds nothing; a slowdown bound of `factor`
    keeps each step holding the high sequence within `factor` times the step with only it.
    At 1.0 the low sequences sit out whole; above it some of them join."""
    sched = scheduler(step_time_targets={HIGH: 1.0}, step_slowdowns={HIGH: factor})
    driver = SchedulerDriver(sched)
    reqs = Requests()
    lows = start_lows(sched, driver, reqs, 20)
    high = reqs.add(sched, [40, 41], priority=HIGH, max_tokens=6)
    decode_steps = joined = 0
    while not high.is_finished:
        alone = StepShape(1, high.num_computed_tokens + 1, 1)  # if this step decodes it
        out, _ = driver.step()
        assert high in out.seqs
        i = out.seqs.index(high)
        if out.num_scheduled_tokens[i] != 1:
            continue
        decode_steps += 1
        assert sched.cost_model.predict(out.shape) <= factor * sched.cost_model.predict(alone) \
            + 1e-12
        joined += len(out.seqs) - 1
        assert out.num_held_back == len(lows) - (len(out.seqs) - 1)
    assert decode_steps == 5
    assert (joined == 0) if factor == 1.0 else (0 < joined < 5 * len(lows))
    assert all(low.num_preemptions == 0 for low in lows)
    driver.run()  # the lows finish once the high one is gone
    assert all(low.is_finished for low in lows)


def test_slowdown_bounds_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="step slowdown of priority 0 must be >= 1"):
        scheduler(step_slowdowns={HIGH: 0.9})
