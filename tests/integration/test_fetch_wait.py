"""The consumer's fetch wait on the embedded broker: short while records flow, the
configured one once they stop (workers/inference/fetch_wait.py).

The embedded broker holds a fetch that finds nothing for its whole wait, reading its log
again at halving intervals; so the wait a fetch carries is how long it takes to come back
from an empty partition, which kafka-python's own fetch-latency metric measures.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kafka import KafkaConsumer, TopicPartition

from core.kafka import make_consumer
from core.settings import Settings
from tests.utils.kafka_topics import create_topic
from workers.inference.fetch_wait import (
    BUSY_FETCH_MAX_WAIT_MS,
    DORMANT_AFTER_S,
    EXPECT_FETCH_MAX_WAIT_MS,
    EXPECT_WINDOW_S,
    LONG_FETCH_MAX_WAIT_MS,
    LONG_WAIT_WORK_FACTOR,
    FetchWait,
)
from workers.inference.loop_pacing import IDLE_POLL_TIMEOUT_MS, poll_timeout_ms


@pytest.fixture
def empty_partition(settings, topic_prefix: str) -> Iterator[tuple[Settings, TopicPartition]]:
    s: Settings = settings()
    topic = f"{topic_prefix}.fetch-wait"
    create_topic(s.kafka_bootstrap_servers, topic, 1)
    yield s, TopicPartition(topic, 0)


def _consumer(s: Settings, tp: TopicPartition) -> KafkaConsumer:
    consumer = make_consumer(s, group_id=f"{tp.topic}.group")
    consumer.assign([tp])
    return consumer


@pytest.fixture
def consumer(empty_partition) -> Iterator[KafkaConsumer]:
    """A consumer assigned the empty partition (its only one)."""
    consumer = _consumer(*empty_partition)
    yield consumer
    consumer.close()


# Work at hand that lasts just long enough for the long wait.
LONG_WORK_S = LONG_WAIT_WORK_FACTOR * LONG_FETCH_MAX_WAIT_MS / 1000


def _fetch_latency_ms(consumer: KafkaConsumer, seconds: float,
                      wait: FetchWait | None = None, **on_poll: object) -> float:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        batches = consumer.poll(timeout_ms=100)
        assert not batches
        if wait is not None:
            wait.on_poll(batches, **on_poll)  # type: ignore[arg-type]
    (latency,) = (value for name, value in consumer.metrics()[
        "consumer-fetch-manager-metrics"].items() if name == "fetch-latency-avg")
    return float(latency)


def test_a_worker_that_fetched_records_lately_waits_briefly_on_an_empty_partition(
        empty_partition) -> None:
    s, tp = empty_partition
    busy, idle = _consumer(s, tp), _consumer(s, tp)
    try:
        wait = FetchWait(busy, window_s=3600)
        wait.on_poll({tp: ["a record"]})
        assert (wait.current_ms, wait.idle_ms) == (BUSY_FETCH_MAX_WAIT_MS, 100)
        busy_ms = _fetch_latency_ms(busy, 2.0, wait)
        idle_ms = _fetch_latency_ms(idle, 2.0)
    finally:
        busy.close()
        idle.close()
    # Each empty fetch comes back after the wait it carried.
    assert busy_ms < 70 and idle_ms > 90, (busy_ms, idle_ms)


def test_the_wait_is_the_configured_one_for_a_full_worker_and_a_quiet_second_after_records(
        consumer) -> None:
    (tp,) = consumer.assignment()
    wait = FetchWait(consumer)
    assert wait.current_ms == 100  # nothing fetched yet
    wait.on_poll({tp: ["a record"]}, now=10.0)
    wait.on_poll({}, now=10.9)
    assert wait.current_ms == BUSY_FETCH_MAX_WAIT_MS
    # A full worker (or one with records waiting to start) needs none sooner.
    wait.on_poll({}, is_hungry=False, now=10.95)
    assert wait.current_ms == 100
    wait.on_poll({}, now=10.96)
    assert wait.current_ms == BUSY_FETCH_MAX_WAIT_MS
    wait.on_poll({}, now=11.0)
    assert wait.current_ms == 100
    # What kafka-python puts in its next fetch request.
    assert consumer._fetcher.config["fetch_max_wait_ms"] == 100


def test_a_full_worker_holding_seconds_of_work_fetches_twice_a_second(consumer) -> None:
    wait = FetchWait(consumer)
    wait.on_poll({}, is_hungry=False, seconds_of_work=LONG_WORK_S)
    assert wait.current_ms == LONG_FETCH_MAX_WAIT_MS  # before the first fetch goes out
    latency_ms = _fetch_latency_ms(consumer, 2.5, wait, is_hungry=False,
                                   seconds_of_work=LONG_WORK_S)
    assert latency_ms > 0.8 * LONG_FETCH_MAX_WAIT_MS, latency_ms


def test_no_long_wait_while_a_more_urgent_record_would_start_at_once(consumer) -> None:
    """Holding seconds of `low` work, a `normal` or `high` record still starts at once: the
    long wait would keep it in the broker for up to half of it."""
    wait = FetchWait(consumer)
    wait.on_poll({}, is_hungry=False, seconds_of_work=float("inf"), can_overtake=True)
    assert wait.current_ms == 100
    wait.on_poll({}, is_hungry=False, seconds_of_work=float("inf"), can_overtake=False)
    assert wait.current_ms == LONG_FETCH_MAX_WAIT_MS
    # Nothing to do for long is still the long wait: any record starts at once anyway.
    wait.on_poll({}, is_idle=True, can_overtake=True, now=10.0)
    wait.on_poll({}, is_idle=True, can_overtake=True, now=10.0 + DORMANT_AFTER_S)
    assert wait.current_ms == LONG_FETCH_MAX_WAIT_MS


def test_the_long_wait_needs_work_for_four_times_its_length(consumer) -> None:
    (tp,) = consumer.assignment()
    wait = FetchWait(consumer)
    wait.on_poll({}, is_hungry=False, seconds_of_work=0.99 * LONG_WORK_S, now=5.0)
    assert wait.current_ms == 100
    wait.on_poll({}, is_hungry=False, seconds_of_work=float("inf"), now=5.1)
    assert wait.current_ms == LONG_FETCH_MAX_WAIT_MS
    # With room and records flowing too: a record sooner would wait behind that work.
    wait.on_poll({tp: ["a record"]}, seconds_of_work=float("inf"), now=5.2)
    assert wait.current_ms == LONG_FETCH_MAX_WAIT_MS
    wait.on_poll({}, seconds_of_work=1.0, now=5.3)
    assert wait.current_ms == BUSY_FETCH_MAX_WAIT_MS
    wait.on_poll({}, seconds_of_work=1.0, now=7.0)
    assert wait.current_ms == 100
    assert consumer._fetcher.config["fetch_max_wait_ms"] == 100


def test_a_worker_with_nothing_to_do_for_a_while_fetches_twice_a_second(consumer) -> None:
    (tp,) = consumer.assignment()
    wait = FetchWait(consumer)
    wait.on_poll({}, is_idle=True, now=100.0)
    wait.on_poll({}, is_idle=True, now=100.0 + 0.99 * DORMANT_AFTER_S)
    assert wait.current_ms == 100
    wait.on_poll({}, is_idle=True, now=100.0 + DORMANT_AFTER_S)
    assert wait.current_ms == LONG_FETCH_MAX_WAIT_MS
    assert consumer._fetcher.config["fetch_max_wait_ms"] == LONG_FETCH_MAX_WAIT_MS
    # A record ends the lull at once, and the next one is counted from scratch.
    wait.on_poll({tp: ["a record"]}, is_idle=True, now=200.0)
    assert wait.current_ms == BUSY_FETCH_MAX_WAIT_MS
    wait.on_poll({}, is_idle=True, now=200.0 + 0.99 * DORMANT_AFTER_S)
    assert wait.current_ms == 100
    # So does work in flight, even with no record fetched meanwhile.
    wait.on_poll({}, is_idle=True, now=300.0)
    assert wait.current_ms == LONG_FETCH_MAX_WAIT_MS
    wait.on_poll({}, is_idle=False, now=300.1)
    assert wait.current_ms == 100
    # The moment the work runs out, the next record is as likely soon as while records
    # flow (a client sending requests one after another): the short wait, for a window.
    wait.on_poll({}, is_idle=True, now=300.2)
    assert wait.current_ms == BUSY_FETCH_MAX_WAIT_MS
    wait.on_poll({}, is_idle=True, now=300.9)
    assert wait.current_ms == BUSY_FETCH_MAX_WAIT_MS
    wait.on_poll({}, is_idle=True, now=301.3)
    assert wait.current_ms == 100
    assert consumer._fetcher.config["fetch_max_wait_ms"] == 100


def test_the_moment_the_work_runs_out_fetches_wait_briefly_for_a_window(consumer) -> None:
    (tp,) = consumer.assignment()
    wait = FetchWait(consumer)
    assert wait.before_poll(is_idle=True, now=50.0) is None  # never busy: nothing ran out
    wait.on_poll({}, is_idle=False, now=50.0)
    assert wait.before_poll(is_idle=False, now=50.1) is None
    # The last job just finished: the fetch about to go out already carries the short wait.
    left = wait.before_poll(is_idle=True, now=50.2)
    assert left == pytest.approx(EXPECT_WINDOW_S)
    assert consumer._fetcher.config["fetch_max_wait_ms"] == EXPECT_FETCH_MAX_WAIT_MS
    # The loop's poll lasts no longer than the window, so the wait changes back after it.
    assert poll_timeout_ms(0, left) == round(1000 * EXPECT_WINDOW_S) < IDLE_POLL_TIMEOUT_MS
    assert poll_timeout_ms(0) == IDLE_POLL_TIMEOUT_MS
    assert poll_timeout_ms(1, left) == 0
    wait.on_poll({}, is_idle=True, now=50.2 + EXPECT_WINDOW_S / 2)
    assert wait.current_ms == EXPECT_FETCH_MAX_WAIT_MS
    assert wait.before_poll(is_idle=True, now=50.2 + EXPECT_WINDOW_S / 2) == pytest.approx(
        EXPECT_WINDOW_S / 2)
    # Nothing came within the window: the wait of a worker whose records flowed lately.
    wait.on_poll({}, is_idle=True, now=50.2 + EXPECT_WINDOW_S)
    assert wait.current_ms == BUSY_FETCH_MAX_WAIT_MS
    assert wait.before_poll(is_idle=True, now=50.3 + EXPECT_WINDOW_S) is None
    # A record ends the window at once, and so does work taken on.
    wait.on_poll({tp: ["a record"]}, is_idle=False, now=60.0)
    wait.before_poll(is_idle=True, now=60.1)
    wait.on_poll({tp: ["a record"]}, is_idle=True, now=60.11)
    assert wait.current_ms == BUSY_FETCH_MAX_WAIT_MS
    wait.on_poll({}, is_idle=False, now=60.2)
    wait.before_poll(is_idle=True, now=60.3)
    wait.on_poll({}, is_idle=False, now=60.31)
    assert wait.current_ms == BUSY_FETCH_MAX_WAIT_MS


def test_an_empty_fetch_comes_back_after_the_expectant_wait(empty_partition) -> None:
    s, tp = empty_partition
    expectant, busy = _consumer(s, tp), _consumer(s, tp)
    try:
        wait = FetchWait(expectant, expect_window_s=3600)
        wait.on_poll({}, is_idle=False)
        wait.before_poll(is_idle=True)
        expect_ms = _fetch_latency_ms(expectant, 2.0, wait, is_idle=True)
        busy_wait = FetchWait(busy, window_s=3600)
        busy_wait.on_poll({tp: ["a record"]})
        busy_ms = _fetch_latency_ms(busy, 2.0, busy_wait)
    finally:
        expectant.close()
        busy.close()
    assert expect_ms < busy_ms / 2 and busy_ms < 70, (expect_ms, busy_ms)
