"""Tenants' share of a step: over-share tenants join under the tenant step target."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.engine.scheduler_driver import Requests, SchedulerDriver
from tests.unit.engine.test_engine import greedy, make_engine, run_all
from tests.unit.engine.test_latency_classes import LOW, NORMAL, law, scheduler
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_cost import StepShape
from workers.engine.tenant_share import MIN_OVER_SHARE_ROOM, over_share_cap, split_by_share

TENANT_TARGET = 0.003  # seconds; B's 4 decodes cost ~2.3 ms under `law`, A's ~80 us each


def start(sched: Scheduler, driver: SchedulerDriver, reqs: Requests, tenant: str | None,
          n: int, max_tokens: int = 40, weight: float = 1.0) -> list[Sequence]:
    """n sequences of one tenant, prefilled in one step."""
    seqs = [reqs.add(sched, [3 + i, 4, 5, 6], priority=LOW, tenant=tenant, weight=weight,
                     max_tokens=max_tokens) for i in range(n)]
    driver.step()
    assert all(s.status is SequenceStatus.RUNNING for s in seqs)
    return seqs


def test_split_by_share_finds_the_tenant_over_its_weighted_share() -> None:
    sched = scheduler()
    reqs = Requests()
    a = [reqs.add(sched, [3], tenant="a", priority=LOW) for _ in range(6)]
    b = [reqs.add(sched, [3], tenant="b", priority=LOW) for _ in range(2)]
    assert split_by_share(a + b, [], LOW) == (b, a)  # shares 4 and 4
    assert split_by_share(a[:1] + b + a[1:2], [], LOW) == (a[:1] + b + a[1:2], [])  # 2 and 2
    a[0].append_token(7, None)  # served more: the others come first
    assert split_by_share(a + b, [], LOW)[1] == a[1:] + a[:1]
    heavy = [reqs.add(sched, [3], tenant="h", weight=3.0, priority=LOW) for _ in range(6)]
    assert split_by_share(heavy + b, [], LOW)[1] == []  # h's share 6 of 8
    # A tenant only waiting at the level counts in the weights: 6 running of a, 2 of b,
    # c waiting: shares 8/3 each, so b is under and a over.
    c = reqs.add(sched, [3], tenant="c", priority=LOW)
    other_level = reqs.add(sched, [3], tenant="d", priority=NORMAL)
    assert split_by_share(a + b, [c, other_level], LOW) == (b, a[1:] + a[:1])
    assert split_by_share(a, [c], LOW) == (a, [])  # one tenant running: nothing to protect


def batches(sched: Scheduler, setup: list[tuple[str | None, int]]) -> list[list[tuple[str, int]]]:
    """Every step's (request id, tokens) until done, for tenants of equal counts."""
    driver = SchedulerDriver(sched)
    reqs = Requests()
    for tenant, n in setup:
        for _ in range(n):
            reqs.add(sched, [3 + reqs.count, 4, 5, 6, 7], priority=LOW, tenant=tenant,
                     max_tokens=30)
    steps = []
    while sched.has_unfinished():
        out, _ = driver.step()
        steps.append([(s.request_id, n) for s, n in
                      zip(out.seqs, out.num_scheduled_tokens, strict=True)])
    return steps


@pytest.mark.parametrize("setup", [[("only", 20)], [(None, 12)], [("a", 8), ("b", 8)],
                                   [("a", 5), ("b", 5), ("c", 5)]])
def test_a_lone_tenant_or_equal_counts_schedule_exactly_as_without_the_cap(
        setup: list[tuple[str | None, int]]) -> None:
    without = batches(scheduler(), setup)
    with_cap = batches(scheduler(tenant_step_target=1e-9), setup)
    assert with_cap == without


def test_over_share_sequences_sit_out_to_keep_the_step_within_the_target() -> None:
    sched = scheduler(tenant_step_target=TENANT_TARGET)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    a = start(sched, driver, reqs, "a", 20)
    b = start(sched, driver, reqs, "b", 4, max_tokens=10)
    steps = 0
    while not all(s.is_finished for s in b):
        pending_b = [s for s in b if not s.is_finished]
        out, _ = driver.step()
        steps += 1
        assert all(s in out.seqs for s in pending_b)  # B's sequences all run
        ran_a = [s for s in out.seqs if s in a]
        assert 1 <= len(ran_a) < len(a)  # the floor, and the cap
        assert out.num_held_back == len(a) - len(ran_a)
        # Within the cap, but for the floor's one sequence beyond it (shapes after the
        # step: a decode's KV is its computed tokens).
        b_shape = StepShape(len(b), sum(s.num_computed_tokens for s in b), len(b))
        cap = over_share_cap(TENANT_TARGET, None, 0.0, law(b_shape))
        one_a = law(out.shape) - law(out.shape.plus(-1, -ran_a[0].num_computed_tokens, -1))
        assert law(out.shape) <= cap * 1.02 + one_a
    assert steps == 9  # B's nine decodes, one per step
    # Held back in turns: A's sequences are at most one token apart.
    assert max(s.num_output_tokens for s in a) - min(s.num_output_tokens for s in a) <= 1
    # B gone: A alone again runs whole, nothing held back, nothing recomputed.
    out, _ = driver.step()
    assert sorted(out.seqs, key=id) == sorted(a, key=id) and out.num_held_back == 0
    driver.run()
    assert all(s.num_output_tokens == 40 for s in a)
    assert sched.num_preemptions == 0


def test_an_over_share_tenant_is_never_starved_by_a_target_no_step_meets() -> None:
    """Target 1 ns: the over-share tenant still gets its floor and at least
    MIN_OVER_SHARE_ROOM of the under-share part's cost every step, and finishes."""
    sched = scheduler(tenant_step_target=1e-9)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    a = start(sched, driver, reqs, "a", 24, max_tokens=30)
    b = start(sched, driver, reqs, "b", 8, max_tokens=30)
    model = sched.cost_model
    while not all(s.is_finished for s in b):
        out, _ = driver.step()
        ran_a = [s for s in out.seqs if s in a]
        ran_b = [s for s in out.seqs if s in b]
        assert ran_a and len(ran_b) == len(b)
        # The step holds B's part and at least half of it again (within one A sequence).
        b_part = model.predict(StepShape(len(b), sum(s.num_computed_tokens for s in b), len(b)))
        one_a = model.predict(out.shape) - model.predict(out.shape.plus(
            -1, -ran_a[-1].num_computed_tokens, -1))
        assert model.predict(out.shape) + one_a >= b_part * (1 + MIN_OVER_SHARE_ROOM)
        assert len(ran_a) >= len(ran_b) // 2
    assert all(s.num_output_tokens >= 1 + 29 // 2 for s in a)  # A kept moving all along
    driver.run()
    assert all(s.num_output_tokens == 30 for s in a)


def test_weights_decide_who_is_over_share() -> None:
    """A with weight 4 may run 4x B's count: 16 of A beside 4 of B is within its share."""
    sched = scheduler(tenant_step_target=1e-9)
    driver = SchedulerDriver(sched)
    reqs = Requests()
    a = start(sched, driver, reqs, "a", 16, weight=4.0)
    b = start(sched, driver, reqs, "b", 4)
    out, _ = driver.step()
    assert out.num_held_back == 0 and len(out.seqs) == len(a) + len(b)


def test_a_non_positive_tenant_target_is_refused() -> None:
    with pytest.raises(ValueError, match="tenant_step_target"):
        scheduler(tenant_step_target=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-tenants")
    save_tiny_llama(path, seed=11)
    return path


def test_greedy_outputs_do_not_depend_on_the_tenant_cap(model_dir: Path) -> None:
    """Token for token the same with the cap off and with a cap no step meets (B's
    sequences run with a floor of A's beside them, the rest of A's sit steps out)."""
    outputs = []
    for target in (None, 1e-9):
        engine = make_engine(model_dir, tenant_step_target=target)
        for i in range(12):
            engine.add_request(f"a{i}", [5 + i, 6, 7, 8, 9], greedy(24), priority=2,
                               tenant="a")
        for _ in range(10):  # enough steps to fit the cost model
            engine.step()
        assert engine.scheduler.cost_model.is_fitted
        for i in range(3):
            engine.add_request(f"b{i}", [40 + i, 41, 42], greedy(12), priority=2, tenant="b")
        outputs.append({rid: outs[-1].token_ids for rid, outs in run_all(engine).items()})
        held = engine.stats().num_held_back_steps
        assert (held > 0) == (target is not None)
    assert outputs[0] == outputs[1]
