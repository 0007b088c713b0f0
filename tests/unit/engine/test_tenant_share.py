"""Tenants' share of a step: over-share tenants join within a cap bounded by their loss."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.unit.engine.scheduler_driver import Requests, SchedulerDriver
from tests.unit.engine.test_engine import greedy, make_engine, run_all
from tests.unit.engine.test_latency_classes import LOW, NORMAL, fitted_model, law, scheduler
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_cost import StepCostModel, StepShape
from workers.engine.tenant_share import (
    LOSS_WINDOW_S,
    TenantShare,
    fair_time_cap,
    loss_bound_cap,
    lost_seconds,
    split_by_share,
)


def start(sched: Scheduler, driver: SchedulerDriver, reqs: Requests, tenant: str | None,
          n: int, max_tokens: int = 40, weight: float = 1.0) -> list[Sequence]:
    """n sequences of one tenant, prefilled in one step."""
    seqs = [reqs.add(sched, [3 + i, 4, 5, 6], priority=LOW, tenant=tenant, weight=weight,
                     max_tokens=max_tokens) for i in range(n)]
    driver.step()
    assert all(s.status is SequenceStatus.RUNNING for s in seqs)
    return seqs


def decode_shape(seqs: list[Sequence]) -> StepShape:
    """One decode of each of these sequences, as priced after the step (a decode's KV is
    its computed tokens then)."""
    return StepShape(len(seqs), sum(s.num_computed_tokens for s in seqs), len(seqs))


def test_split_by_share_finds_the_tenant_over_its_weighted_share() -> None:
    sched = scheduler()
    reqs = Requests()
    a = [reqs.add(sched, [3], tenant="a", priority=LOW) for _ in range(6)]
    b = [reqs.add(sched, [3], tenant="b", priority=LOW) for _ in range(2)]
    split = split_by_share(a + b, [], LOW)  # shares 4 and 4
    assert (split.under, split.over, split.over_weight_fraction) == (b, a, 0.5)
    level = a[:1] + b + a[1:2]
    assert split_by_share(level, [], LOW).under is level  # 2 and 2: nobody over
    assert split_by_share(level, [], LOW).over == []
    a[0].append_token(7, None)  # served more: the others come first
    assert split_by_share(a + b, [], LOW).over == a[1:] + a[:1]
    heavy = [reqs.add(sched, [3], tenant="h", weight=3.0, priority=LOW) for _ in range(6)]
    assert split_by_share(heavy + b, [], LOW).over == []  # h's share 6 of 8
    # A tenant only waiting at the level counts in the shares, not in the fraction of the
    # running weights: 6 running of a, 2 of b, c waiting: shares 8/3 each, a over.
    c = reqs.add(sched, [3], tenant="c", priority=LOW)
    other_level = reqs.add(sched, [3], tenant="d", priority=NORMAL)
    split = split_by_share(a + b, [c, other_level], LOW)
    assert (split.under, split.over, split.over_weight_fraction) == (b, a[1:] + a[:1], 0.5)
    assert split_by_share(a, [c], LOW).over == []  # one tenant running: nothing to protect


@pytest.mark.parametrize("under_s,full_s", [(1.0, 10.0), (2.0, 3.0), (0.01, 0.5)])
@pytest.mark.parametrize("max_loss", [0.05, 0.1, 0.5])
def test_the_loss_bound_cap_costs_exactly_the_loss_allowed(under_s: float, full_s: float,
                                                           max_loss: float) -> None:
    cap = loss_bound_cap(under_s, full_s, max_loss)
    assert under_s < cap < full_s
    assert lost_seconds(under_s, full_s, cap) == pytest.approx(max_loss * cap)
    # Their throughput at the cap, against all of them in full_s, with a cost per unit of
    # their work c: (cap - under) / c tokens in cap seconds vs (full - under) / c in full.
    kept = (cap - under_s) / cap / ((full_s - under_s) / full_s)
    assert kept == pytest.approx(1 - max_loss)
    assert lost_seconds(under_s, full_s, full_s) == 0.0  # not held: nothing lost
    assert lost_seconds(under_s, full_s, under_s) == pytest.approx(under_s)  # all held
    # The fair time share is deeper where the under-share part is small.
    if under_s / full_s < 0.3 and max_loss <= 0.1:
        assert fair_time_cap(under_s, 0.5) < cap


def test_the_fair_time_cap_holds_only_while_there_is_credit() -> None:
    share = TenantShare(0.1)
    assert share.credit_s == pytest.approx(0.1 * LOSS_WINDOW_S)
    under_s, full_s = 1.0, 10.0
    deep = fair_time_cap(under_s, 0.5)
    assert share.cap(under_s, full_s, 0.5) == deep == 2.0
    while share.credit_s > 0:  # each deep step costs far more than it earns
        share.settle(deep, lost_seconds(under_s, full_s, deep))
    assert share.cap(under_s, full_s, 0.5) == loss_bound_cap(under_s, full_s, 0.1)
    # Steps at the loss bound earn what they cost: the credit stays where it is.
    cap = share.cap(under_s, full_s, 0.5)
    credit = share.credit_s
    share.settle(cap, lost_seconds(under_s, full_s, cap))
    assert share.credit_s == pytest.approx(credit)
    # Uncapped steps (no other tenant) earn it back, up to the window's worth.
    for _ in range(10_000):
        share.settle(full_s, 0.0)
    assert share.credit_s == pytest.approx(share.max_credit_s)
    assert share.cap(under_s, full_s, 0.5) == deep


@pytest.mark.parametrize("max_loss", [0.0, 1.0, -0.1])
def test_a_max_loss_outside_0_1_is_refused(max_loss: float) -> None:
    with pytest.raises(ValueError, match="max_loss"):
        scheduler(tenant_max_loss=max_loss)


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
    with_cap = batches(scheduler(tenant_max_loss=0.9), setup)
    assert with_cap == without


def test_over_share_sequences_sit_out_to_keep_the_step_within_the_cap() -> None:
    sched = scheduler(tenant_max_loss=0.5)
    assert sched.tenant_share is not None
    sched.tenant_share.credit_s = 0.0  # the loss bound alone
    driver = SchedulerDriver(sched)
    reqs = Requests()
    a = start(sched, driver, reqs, "a", 20)
    b = start(sched, driver, reqs, "b", 4, max_tokens=10)
    steps = 0
    while not all(s.is_finished for s in b):
        pending_b = [s for s in b if not s.is_finished]
        full_a = decode_shape(a)
        out, _ = driver.step()
        steps += 1
        assert all(s in out.seqs for s in pending_b)  # B's sequences all run
        ran_a = [s for s in out.seqs if s in a]
        assert 1 <= len(ran_a) < len(a)  # the floor, and the cap
        assert out.num_held_back == len(a) - len(ran_a)
        under = decode_shape(pending_b)
        under_s = law(under)
        full_s = law(under.plus(full_a.num_tokens, full_a.num_kv_tokens + len(a), len(a)))
        cap = loss_bound_cap(under_s, full_s, 0.5)
        one_a = law(out.shape) - law(out.shape.plus(-1, -ran_a[0].num_computed_tokens, -1))
        # At the cap, beyond it by at most the A decode that crossed it.
        assert cap * 0.98 <= law(out.shape) <= cap + one_a * 1.05
        sched.tenant_share.credit_s = 0.0
    assert steps == 9  # B's nine decodes, one per step
    # Held back in turns: A's sequences are at most one token apart.
    assert max(s.num_output_tokens for s in a) - min(s.num_output_tokens for s in a) <= 1
    # B gone: A alone again runs whole, nothing held back, nothing recomputed.
    out, _ = driver.step()
    assert sorted(out.seqs, key=id) == sorted(a, key=id) and out.num_held_back == 0
    driver.run()
    assert all(s.num_output_tokens == 40 for s in a)
    assert sched.num_preemptions == 0


def light_law(shape: StepShape) -> float:
    """`law` with a tenth of its fixed cost: the step's size, not its start, dominates."""
    return law(shape) - 0.0018


def light_model() -> StepCostModel:
    """A cost model that has watched a few hundred steps of a machine following light_law."""
    return fitted_model(light_law)


def test_with_credit_the_over_share_tenant_gets_its_fair_share_of_the_step_time() -> None:
    """Where B's part is small beside A's (the step's fixed cost small), the fair time cap
    (2 x B's part for two equal tenants) is deeper than the loss bound and holds while A
    has credit; once the credit is spent the loss bound holds."""
    sched = scheduler(tenant_max_loss=0.1, cost_model=light_model())
    driver = SchedulerDriver(sched)
    reqs = Requests()
    a = start(sched, driver, reqs, "a", 24, max_tokens=30)
    b = start(sched, driver, reqs, "b", 2, max_tokens=12)
    while not all(s.is_finished for s in b):
        pending_b = [s for s in b if not s.is_finished]
        out, _ = driver.step()
        ran_a = [s for s in out.seqs if s in a]
        assert all(s in out.seqs for s in pending_b) and ran_a
        b_s = light_law(decode_shape(pending_b))
        step_s = light_law(out.shape)
        one_a = step_s - light_law(out.shape.plus(-1, -ran_a[0].num_computed_tokens, -1))
        # A's part is half the step (the fair cap 2 x B's part), beyond by one of its decodes.
        assert 2 * b_s * 0.98 <= step_s <= 2 * b_s + one_a * 1.05
        assert len(ran_a) < len(a) // 2
    assert sched.tenant_share is not None and sched.tenant_share.credit_s > 0
    more_b = start(sched, driver, reqs, "b", 2, max_tokens=12)
    sched.tenant_share.credit_s = 0.0
    out, _ = driver.step()
    ran_a = [s for s in out.seqs if s in a]
    under = decode_shape(more_b)
    full = under.plus(len(a), sum(s.num_computed_tokens + 1 for s in a), len(a))
    cap = loss_bound_cap(light_law(under), light_law(full), 0.1)
    one_a = light_law(out.shape) - light_law(out.shape.plus(
        -1, -ran_a[0].num_computed_tokens, -1))
    assert cap * 0.98 <= light_law(out.shape) <= cap + one_a * 1.05
    driver.run()
    assert all(s.num_output_tokens == 30 for s in a)


@pytest.mark.parametrize("seed", range(8))
def test_random_arrivals_starve_neither_tenant_and_bound_the_big_ones_loss(seed: int) -> None:
    """Tenants come and go at random (counts, lengths, weights); at every step each tenant
    with a running decode has one in the step, every request finishes, and the loss the cap
    charged the over-share tenants stays within max_loss of the time plus the credit."""
    rng = random.Random(seed)
    max_loss = rng.choice([0.05, 0.1, 0.3])
    sched = scheduler(tenant_max_loss=max_loss, step_time_targets={})
    share = sched.tenant_share
    assert share is not None
    share.max_credit_s = share.credit_s = rng.choice([0.0, 0.01, 1.0])
    credit0 = share.credit_s
    driver = SchedulerDriver(sched)
    reqs = Requests()
    weights = {"a": rng.choice([1.0, 2.0]), "b": 1.0, "c": rng.choice([0.5, 1.0])}
    charged = earned = 0.0
    settle = share.settle

    def watched_settle(step_s: float, lost_s: float) -> None:
        nonlocal charged, earned
        charged += lost_s
        earned += max_loss * step_s
        settle(step_s, lost_s)

    share.settle = watched_settle  # type: ignore[method-assign]
    all_seqs: list[Sequence] = []
    for step_no in range(400):
        if step_no < 300 and rng.random() < 0.3:
            tenant = rng.choice(["a", "a", "b", "c"])
            for _ in range(rng.randint(1, 12 if tenant == "a" else 3)):
                all_seqs.append(reqs.add(
                    sched, [3 + reqs.count % 50, 4, 5, 6], priority=LOW, tenant=tenant,
                    weight=weights[tenant], max_tokens=rng.randint(1, 40)))
        decoding = {s.tenant for s in sched.running if s.num_uncomputed_tokens == 1}
        if not sched.has_unfinished():
            continue
        out, _ = driver.step()
        assert decoding <= {s.tenant for s in out.seqs}, "a tenant's decodes all sat out"
    driver.run()
    assert all(s.is_finished for s in all_seqs)
    assert charged <= earned + credit0 + 1e-9
    assert sched.num_held_back_steps > 0  # the cap did bind somewhere


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-tenants")
    save_tiny_llama(path, seed=11)
    return path


def test_greedy_outputs_do_not_depend_on_the_tenant_cap(model_dir: Path) -> None:
    """Token for token the same with the cap off and with the deepest cap (B's sequences
    run with a part of A's beside them, the rest of A's sit steps out)."""
    outputs = []
    for max_loss in (None, 0.9):
        engine = make_engine(model_dir, tenant_max_loss=max_loss)
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
        assert (held > 0) == (max_loss is not None)
    assert outputs[0] == outputs[1]


def sustained_run(max_loss: float | None, credit_s: float) -> tuple[float, float]:
    """A's 24 long sequences beside B keeping 2 short ones running, 120 steps on a machine
    following light_law: (A's tokens per simulated second, B's seconds per step)."""
    sched = scheduler(tenant_max_loss=max_loss, cost_model=light_model(),
                      step_time_targets={})
    if sched.tenant_share is not None:
        sched.tenant_share.credit_s = credit_s
    driver = SchedulerDriver(sched)
    reqs = Requests()
    a = start(sched, driver, reqs, "a", 24, max_tokens=1000)
    b: list[Sequence] = []
    clock = 0.0
    num_a_tokens = 0
    for _ in range(120):
        b = [s for s in b if not s.is_finished]
        while len(b) < 2:
            b.append(reqs.add(sched, [40 + reqs.count, 4, 5, 6], priority=LOW, tenant="b",
                              max_tokens=6))
        out, _ = driver.step()
        clock += light_law(out.shape)
        num_a_tokens += sum(1 for s in out.seqs if s in a)
    return num_a_tokens / clock, clock / 120


def test_a_sustained_small_tenant_costs_the_big_one_at_most_max_loss() -> None:
    """Over a long run (no credit left), B's steps are much shorter with the cap, and A's
    rate stays within max_loss of its rate without it (as the cost model prices steps)."""
    a_rate, b_step_s = sustained_run(None, 0.0)
    a_rate_capped, b_step_capped_s = sustained_run(0.1, 0.0)
    assert a_rate_capped >= 0.9 * a_rate * 0.98
    assert b_step_capped_s < 0.7 * b_step_s
    # With credit (a burst), deeper: B's steps shorter still, A pays more for a while.
    a_rate_burst, b_step_burst_s = sustained_run(0.1, 1.0)
    assert b_step_burst_s < 0.8 * b_step_capped_s and a_rate_burst < a_rate_capped
