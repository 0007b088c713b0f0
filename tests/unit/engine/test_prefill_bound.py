"""The prefill bound: no step's prefill outgrows `max_prefill_step_time`, so work that
arrives mid-step is not kept out by a wide prefill of less urgent work."""

from __future__ import annotations

import pytest

from tests.unit.engine.scheduler_driver import Requests, SchedulerDriver, make_scheduler
from tests.unit.engine.test_latency_classes import fitted_model, law
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import SequenceStatus
from workers.engine.step_cost import EMPTY_STEP

NORMAL, LOW = 1, 2
BOUND = 0.003  # seconds of prefill: ~55 tokens under `law` (2 ms + 50 us/token + ...)


def scheduler(bound: float | None = BOUND) -> Scheduler:
    return make_scheduler(num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=1024,
                          cost_model=fitted_model(), max_prefill_step_time=bound)


def prefill_cost(sched: Scheduler, seqs_tokens: list[tuple[int, int]]) -> float:
    """Predicted seconds these (new tokens, KV read) prefill chunks add to a step."""
    shape = EMPTY_STEP
    for num_new, num_kv in seqs_tokens:
        shape = shape.plus(num_new, num_kv)
    return sched.cost_model.predict(shape) - sched.cost_model.coefficients()[0]


def test_wide_low_prefill_is_spread_over_steps_within_the_bound() -> None:
    runs = {}
    for bound in (None, BOUND):
        sched = scheduler(bound)
        driver = SchedulerDriver(sched)
        reqs = Requests()
        lows = [reqs.add(sched, [5 + i] * 40, priority=LOW, max_tokens=4) for i in range(20)]
        out, _ = driver.step()
        chunks = [(n, s.num_computed_tokens) for s, n in zip(out.seqs, out.num_scheduled_tokens,
                                                             strict=True)]
        runs[bound] = (sum(n for n, _ in chunks), driver.run(), [s.token_ids for s in lows])
        if bound is not None:
            # num_computed_tokens was advanced by the step: it is the KV each chunk read.
            assert prefill_cost(sched, chunks) <= BOUND
    first_unbounded, steps_unbounded, tokens_unbounded = runs[None]
    first_bounded, steps_bounded, tokens_bounded = runs[BOUND]
    assert first_unbounded == 800  # every prompt in one step: the budget allows it
    assert 4 <= first_bounded < 100
    assert steps_bounded > steps_unbounded
    assert tokens_bounded == tokens_unbounded  # the same work, in more, shorter steps


def test_a_normal_job_arriving_mid_prefill_waits_one_short_step() -> None:
    sched = scheduler()
    driver = SchedulerDriver(sched)
    reqs = Requests()
    for i in range(20):
        reqs.add(sched, [5 + i] * 40, priority=LOW, max_tokens=4)
    driver.step()  # the low prefill under way; the normal job arrives now
    assert any(s.status is SequenceStatus.WAITING for s in sched.waiting)
    normal = reqs.add(sched, [99] * 8, priority=NORMAL, max_tokens=3)
    out, _ = driver.step()
    assert normal in out.seqs and normal.num_output_tokens == 1  # its whole prompt at once


def test_decodes_are_never_held_back_by_the_bound() -> None:
    sched = scheduler(bound=1e-6)  # below what any step costs
    driver = SchedulerDriver(sched)
    reqs = Requests()
    lows = [reqs.add(sched, [5 + i] * 20, priority=LOW, max_tokens=30) for i in range(12)]
    while any(s.num_output_tokens == 0 for s in lows):
        driver.step()  # an empty step still prefills a block: every prompt gets through
    for _ in range(5):
        out, _ = driver.step()
        assert all(s in out.seqs for s in lows if not s.is_finished)
        assert law(out.shape) > 1e-6


def test_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_prefill_step_time"):
        scheduler(bound=0.0)
