"""The autoscaler's rule and loop: lag in, worker count out, on an injected clock."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY

from core.kafka import TopicLag
from core.settings import Settings
from scheduler.autoscale_loop import AutoscaleLoop, MainThreadScaler
from scheduler.autoscaler import AutoscalePolicy, Autoscaler
from tests.utils.clock import ManualClock

WEIGHTS = {"high": 4.0, "normal": 1.0, "low": 0.25}
TOPICS = {"high": "bi.jobs.high", "normal": "bi.jobs.normal", "low": "bi.jobs.low"}


def _policy(**overrides: object) -> AutoscalePolicy:
    values: dict = {"min_workers": 1, "max_workers": 8, "lag_threshold": 100,
                    "cooldown_s": 60.0, "weights": WEIGHTS}
    values.update(overrides)
    return AutoscalePolicy(**values)


def _normal(lag: int) -> dict[str, int]:
    return {"normal": lag}


def test_workers_follow_ceil_of_weighted_lag_over_threshold() -> None:
    """0 → min, 1..100 → 1, 101 → 2, 250 → 3 at 100 per worker."""
    policy = _policy(min_workers=0)
    assert [policy.num_workers_for(lag, num_partitions=8) for lag in (0, 1, 100, 101, 250)] \
        == [0, 1, 1, 2, 3]


def test_priorities_are_weighted() -> None:
    """50 high jobs weigh as 200 normal ones, 400 low ones as 100 normal ones."""
    scaler = Autoscaler(_policy(), num_workers=1)
    decision = scaler.observe({"high": 50, "normal": 0, "low": 0}, num_partitions=8, now=0)
    assert decision.num_workers == 2
    assert decision.weighted_lag == {"high": 200.0, "normal": 0.0, "low": 0.0}
    scaler = Autoscaler(_policy(), num_workers=1)
    assert scaler.observe({"low": 400}, num_partitions=8, now=0).num_workers == 1
    assert scaler.observe({"low": 401}, num_partitions=8, now=1).num_workers == 2
    # A priority the policy does not weigh does not count.
    assert scaler.observe({"other": 10_000}, num_partitions=8, now=2).num_workers == 2


def test_scale_up_is_immediate_and_clamped_to_max_and_partitions() -> None:
    """A backlog raises the count on the very reading that shows it, within the limits."""
    scaler = Autoscaler(_policy(max_workers=5), num_workers=1)
    decision = scaler.observe(_normal(350), num_partitions=8, now=0)
    assert (decision.num_previous, decision.num_workers, decision.is_change) == (1, 4, True)
    assert "weighted lag 350" in decision.reason
    assert scaler.observe(_normal(10_000), num_partitions=8, now=1).num_workers == 5
    capped = Autoscaler(_policy(max_workers=5), num_workers=1)
    assert capped.observe(_normal(10_000), num_partitions=3, now=0).num_workers == 3
    assert "3 partitions" in capped.observe(_normal(10_000), num_partitions=3, now=1).reason


def test_min_workers_is_kept_without_lag_and_beats_the_partition_cap() -> None:
    """No lag still leaves min_workers running, even more than there are partitions."""
    scaler = Autoscaler(_policy(min_workers=2, cooldown_s=0), num_workers=2)
    assert scaler.observe(_normal(0), num_partitions=8, now=0).num_workers == 2
    assert scaler.observe(_normal(10_000), num_partitions=1, now=1).num_workers == 2
    assert scaler.observe(_normal(0), num_partitions=0, now=2).num_workers == 2


def test_scale_down_waits_for_a_whole_cooldown_of_lower_readings() -> None:
    """The count drops only when every reading for cooldown_s asked for fewer workers."""
    scaler = Autoscaler(_policy(), num_workers=1)
    assert scaler.observe(_normal(400), num_partitions=8, now=0).num_workers == 4
    waiting = [scaler.observe(_normal(0), num_partitions=8, now=t) for t in (5, 30, 64)]
    assert [d.num_workers for d in waiting] == [4, 4, 4]
    assert "waits 1s more" in waiting[-1].reason
    down = scaler.observe(_normal(0), num_partitions=8, now=65)
    assert (down.num_previous, down.num_workers, down.is_change) == (4, 1, True)
    assert "cooldown 60s" in down.reason


def test_scale_down_goes_to_the_most_asked_for_during_the_cooldown() -> None:
    """Readings asking for 3, then 1: after the cooldown 3 run, and 1 only a cooldown later."""
    scaler = Autoscaler(_policy(), num_workers=4)
    assert scaler.observe(_normal(300), num_partitions=8, now=0).num_workers == 4
    assert scaler.observe(_normal(50), num_partitions=8, now=30).num_workers == 4
    assert scaler.observe(_normal(50), num_partitions=8, now=60).num_workers == 3
    assert scaler.observe(_normal(50), num_partitions=8, now=65).num_workers == 3
    assert scaler.observe(_normal(50), num_partitions=8, now=124).num_workers == 3
    assert scaler.observe(_normal(50), num_partitions=8, now=125).num_workers == 1


def test_a_reading_at_the_current_count_restarts_the_cooldown() -> None:
    """Lag that comes back to the current count, even once, resets the scale-down clock."""
    scaler = Autoscaler(_policy(), num_workers=2)
    scaler.observe(_normal(0), num_partitions=8, now=0)
    scaler.observe(_normal(200), num_partitions=8, now=50)  # asks for 2 again
    assert scaler.observe(_normal(0), num_partitions=8, now=70).num_workers == 2
    assert scaler.observe(_normal(0), num_partitions=8, now=129).num_workers == 2
    assert scaler.observe(_normal(0), num_partitions=8, now=130).num_workers == 1


def test_lag_oscillating_around_a_boundary_does_not_flap() -> None:
    """Lag swinging between 1 and 2 workers' worth every reading: up once, never down."""
    scaler = Autoscaler(_policy(), num_workers=1)
    counts = [scaler.observe(_normal(150 if i % 2 else 90), num_partitions=8,
                             now=5.0 * i).num_workers for i in range(200)]
    assert counts == [1] + [2] * 199


def test_at_most_one_scale_down_per_cooldown() -> None:
    """Falling lag from 8 workers' worth to none, read every 5 s: one step down a minute."""
    scaler = Autoscaler(_policy(), num_workers=8)
    changes = []
    for i in range(80):
        now = 5.0 * i
        decision = scaler.observe(_normal(max(0, 800 - 20 * i)), num_partitions=8, now=now)
        if decision.is_change:
            changes.append((now, decision.num_workers))
    assert changes[-1][1] == 1
    times = [t for t, _ in changes]
    assert all(later - earlier >= 60 for earlier, later in zip(times, times[1:], strict=False))


def test_unreadable_lag_keeps_the_count_and_restarts_the_cooldown() -> None:
    """A failed reading never changes the count, nor lets the next one drain workers."""
    scaler = Autoscaler(_policy(), num_workers=1)
    scaler.observe(_normal(400), num_partitions=8, now=0)
    scaler.observe(_normal(0), num_partitions=8, now=10)
    error = scaler.observe_error("KafkaTimeoutError: no broker")
    assert (error.num_workers, error.is_change, error.weighted_lag) == (4, False, {})
    assert "keeping 4 workers" in error.reason
    assert scaler.observe(_normal(0), num_partitions=8, now=80).num_workers == 4
    assert scaler.observe(_normal(0), num_partitions=8, now=140).num_workers == 1


def test_policy_rejects_unusable_numbers() -> None:
    """min above max, a zero threshold, a negative cooldown or weight fail at start."""
    for bad in ({"min_workers": 3, "max_workers": 2}, {"lag_threshold": 0},
                {"cooldown_s": -1.0}, {"weights": {"high": 0.0}}):
        with pytest.raises(ValueError):
            _policy(**bad)


def test_policy_from_settings() -> None:
    """The settings' defaults make a policy: normal lag is the threshold's unit."""
    policy = AutoscalePolicy.from_settings(Settings(autoscale_max_workers=6))
    assert (policy.min_workers, policy.max_workers, policy.lag_threshold) == (1, 6, 128)
    assert policy.weights == {"high": 4.0, "normal": 1.0, "low": 0.25}
    with pytest.raises(ValueError, match="autoscale_min_workers"):
        Settings(autoscale_min_workers=4, autoscale_max_workers=2)


def _loop(read_lag: Callable[[], dict[str, TopicLag]], calls: list[int], clock: ManualClock,
          num_workers: int = 1) -> AutoscaleLoop:
    return AutoscaleLoop(Autoscaler(_policy(max_workers=4), num_workers=num_workers),
                         read_lag=read_lag, scale_to=calls.append, job_topics=TOPICS,
                         interval_s=5.0, clock=clock, model="m")


def _lag(high: int = 0, normal: int = 0, low: int = 0,
         num_partitions: int = 3) -> dict[str, TopicLag]:
    return {TOPICS["high"]: TopicLag(high, num_partitions),
            TOPICS["normal"]: TopicLag(normal, num_partitions),
            TOPICS["low"]: TopicLag(low, num_partitions)}


def _sample(name: str, labels: dict[str, str] | None = None) -> float | None:
    return REGISTRY.get_sample_value(name, labels or {})


def test_loop_scales_only_on_change_and_exports_gauges(caplog: pytest.LogCaptureFixture) -> None:
    """Readings map topics to priorities; scale_to runs once per change, logged with why."""
    clock = ManualClock()
    readings = [_lag(high=30, normal=50), _lag(high=30, normal=50), _lag(normal=5000)]
    calls: list[int] = []
    loop = _loop(lambda: readings.pop(0), calls, clock)
    caplog.set_level(logging.INFO, logger="scheduler.autoscale_loop")
    assert loop.step().num_workers == 2  # 4 × 30 + 50 = 170
    assert _sample("batchinfer_autoscaler_weighted_lag",
                   {"model": "m", "priority": "high"}) == 120.0
    assert _sample("batchinfer_autoscaler_desired_workers", {"model": "m"}) == 2.0
    clock.now += 5
    loop.step()
    clock.now += 5
    assert loop.step().num_workers == 3, "capped by the topics' 3 partitions"
    assert calls == [2, 3]
    changes = [r.getMessage() for r in caplog.records if "autoscaling" in r.getMessage()]
    assert len(changes) == 2
    assert changes[0].startswith("autoscaling workers of m 1 → 2: weighted lag 170")


def test_loop_keeps_the_count_when_kafka_fails(caplog: pytest.LogCaptureFixture) -> None:
    """Errors never call scale_to; the first is a warning, recovery is logged."""
    clock = ManualClock()
    outcomes: list[dict[str, TopicLag] | Exception] = [
        _lag(normal=300), ConnectionError("broker gone"), TimeoutError("still gone"),
        _lag(normal=0)]

    def read() -> dict[str, TopicLag]:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    calls: list[int] = []
    loop = _loop(read, calls, clock)
    errors_before = _sample("batchinfer_autoscaler_lag_read_errors_total") or 0.0
    caplog.set_level(logging.DEBUG, logger="scheduler.autoscale_loop")
    assert loop.step().num_workers == 3
    for _ in range(2):
        clock.now += 100
        decision = loop.step()
        assert (decision.num_workers, decision.is_change) == (3, False)
    clock.now += 100
    assert loop.step().num_workers == 3, "the first good reading starts the cooldown"
    assert calls == [3]
    assert _sample("batchinfer_autoscaler_lag_read_errors_total") == errors_before + 2
    warnings = [r for r in caplog.records
                if r.name == "scheduler.autoscale_loop" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ConnectionError: broker gone" in warnings[0].getMessage()
    assert any(r.getMessage() == "lag readable again" for r in caplog.records)


def test_loop_run_survives_a_failing_hook_and_stops() -> None:
    """A scale_to that raises is logged; run() keeps stepping until stop is set."""
    stop = threading.Event()
    num_steps = 0

    def read() -> dict[str, TopicLag]:
        nonlocal num_steps
        num_steps += 1
        if num_steps == 3:
            stop.set()
        return _lag(normal=num_steps * 200)

    def scale_to(num_workers: int) -> None:
        raise OSError("cannot spawn")

    loop = AutoscaleLoop(Autoscaler(_policy(), num_workers=1), read_lag=read,
                         scale_to=scale_to, job_topics=TOPICS, interval_s=0.001)
    loop.run(stop)
    assert num_steps == 3


def test_main_thread_scaler_applies_the_latest_count_once() -> None:
    """Counts asked for off the main thread coalesce; apply() hands over the last one."""
    calls: list[int] = []
    scaler = MainThreadScaler(calls.append)
    scaler.apply()

    def ask() -> None:
        scaler(3)
        scaler(2)

    thread = threading.Thread(target=ask)
    thread.start()
    thread.join()
    scaler.apply()
    scaler.apply()
    assert calls == [2]


def test_queued_deadlines_raise_the_count_within_the_limits() -> None:
    """Little lag but deadlines that need 5 workers: 5; never past max or the partitions."""
    scaler = Autoscaler(_policy(), num_workers=1)
    decision = scaler.observe(_normal(50), num_partitions=8, now=0, num_for_deadlines=5)
    assert decision.num_workers == 5 and "deadlines ask for 5" in decision.reason
    assert scaler.observe(_normal(50), num_partitions=8, now=1,
                          num_for_deadlines=50).num_workers == 8
    assert scaler.observe(_normal(50), num_partitions=3, now=2,
                          num_for_deadlines=50).num_workers == 8  # no scale-down at once
    fresh = Autoscaler(_policy(), num_workers=1)
    assert fresh.observe(_normal(50), num_partitions=3, now=0,
                         num_for_deadlines=50).num_workers == 3
    # Deadlines asking for fewer than the lag change nothing.
    assert fresh.observe(_normal(700), num_partitions=8, now=1,
                         num_for_deadlines=2).num_workers == 7
