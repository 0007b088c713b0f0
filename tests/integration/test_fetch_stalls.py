"""Fetch stalls on the real broker and kafka-python: the cause reproduced, fixed, and caught.

A partition whose parsed records kafka-python parked while it was paused is never fetched
again once another partition's batch has been handed out (see
workers/inference/parked_records.py for the worked example). These tests build exactly
that state on the embedded broker, then show that `release_parked_records` prevents it
and that the `StallWatchdog` restarts a partition stalled by it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kafka import KafkaConsumer, TopicPartition
from prometheus_client import REGISTRY

from core.kafka import make_producer
from core.settings import Settings
from tests.utils.kafka_topics import create_topic
from workers.inference.parked_records import release_parked_records
from workers.inference.stall_watchdog import StallWatchdog

RECORDS_PER_PARTITION = 300
POLL_RECORDS = 100


@pytest.fixture
def two_partitions(settings, topic_prefix: str) -> Iterator[tuple[Settings, str]]:
    """A topic with two partitions of RECORDS_PER_PARTITION one-record batches each."""
    s: Settings = settings()
    topic = f"{topic_prefix}.stall"
    create_topic(s.kafka_bootstrap_servers, topic, 2)
    # One record per batch: the embedded broker's end offsets count batches.
    producer = make_producer(s, batch_size=0)
    try:
        for i in range(RECORDS_PER_PARTITION):
            for partition in (0, 1):
                producer.send(topic, value=b"%d" % i, partition=partition)
        producer.flush(timeout=60)
    finally:
        producer.close()
    yield s, topic


def _consumer(s: Settings, topic: str) -> KafkaConsumer:
    consumer = KafkaConsumer(
        bootstrap_servers=s.kafka_bootstrap_servers, group_id=f"{topic}.group",
        enable_auto_commit=False, auto_offset_reset="earliest",
        max_poll_records=POLL_RECORDS, fetch_max_wait_ms=100,
    )
    consumer.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
    return consumer


def _poll(consumer: KafkaConsumer, received: dict[TopicPartition, int]) -> int:
    batches = consumer.poll(timeout_ms=200)
    for tp, records in batches.items():
        received[tp] = received.get(tp, 0) + len(records)
    return sum(len(records) for records in batches.values())


def _park_both(consumer: KafkaConsumer, received: dict[TopicPartition, int]) -> None:
    """Pause each partition while its batch is half handed out, then resume both."""
    deadline = time.monotonic() + 30
    while not _poll(consumer, received):
        assert time.monotonic() < deadline, "no records fetched"
    (first,) = (tp for tp, n in received.items() if n)
    consumer.pause(first)
    deadline = time.monotonic() + 30
    while len([n for n in received.values() if n]) < 2:
        _poll(consumer, received)
        assert time.monotonic() < deadline, "the second partition was never fetched"
    consumer.pause(*consumer.assignment())
    _poll(consumer, received)
    parked = consumer._fetcher._paused_partition_records
    assert set(parked) == consumer.assignment(), "both partitions hold parked records"
    consumer.resume(*consumer.assignment())


def _drain(consumer: KafkaConsumer, received: dict[TopicPartition, int], seconds: float,
           *, before_poll=lambda: None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and sum(received.values()) < 2 * RECORDS_PER_PARTITION:
        before_poll()
        _poll(consumer, received)


def test_a_partition_parked_beside_another_is_never_fetched_again(two_partitions) -> None:
    """The library's behaviour that stalled workers: one partition stuck mid-way."""
    s, topic = two_partitions
    consumer = _consumer(s, topic)
    try:
        received: dict[TopicPartition, int] = {}
        _park_both(consumer, received)
        _drain(consumer, received, seconds=5)
        assert sorted(received.values()) == [POLL_RECORDS, RECORDS_PER_PARTITION], received
    finally:
        consumer.close(autocommit=False)


def test_releasing_parked_records_before_each_poll_delivers_everything(two_partitions) -> None:
    s, topic = two_partitions
    consumer = _consumer(s, topic)
    try:
        received: dict[TopicPartition, int] = {}
        _park_both(consumer, received)
        _drain(consumer, received, seconds=60,
               before_poll=lambda: release_parked_records(consumer))
        assert sorted(received.values()) == [RECORDS_PER_PARTITION] * 2, received
    finally:
        consumer.close(autocommit=False)


def test_the_watchdog_restarts_a_stalled_partition_from_its_committed_offset(
    two_partitions,
) -> None:
    s, topic = two_partitions
    consumer = _consumer(s, topic)
    stalls_before = _stall_count(topic)
    try:
        received: dict[TopicPartition, int] = {}
        _park_both(consumer, received)
        watchdog = StallWatchdog(consumer, stall_after_s=1.0)
        watchdog.on_assigned(consumer.assignment())
        _drain(consumer, received, seconds=5)  # one partition drains, the other is stuck
        assert sorted(received.values()) == [POLL_RECORDS, RECORDS_PER_PARTITION], received
        (stuck,) = [tp for tp, n in received.items() if n == POLL_RECORDS]
        deadline = time.monotonic() + 30
        restarted: set[TopicPartition] = set()
        while not restarted:
            assert time.monotonic() < deadline, "the watchdog never noticed the stall"
            watchdog.on_records(tp for tp, records in consumer.poll(timeout_ms=200).items()
                                if records)
            restarted = watchdog.check(is_idle=True)
        assert restarted == {stuck}
        # Nothing was committed, so the partition starts over from its beginning.
        received[stuck] = 0
        _drain(consumer, received, seconds=60)
        assert received[stuck] == RECORDS_PER_PARTITION
        assert _stall_count(topic) == stalls_before + 1
    finally:
        consumer.close(autocommit=False)


def _stall_count(topic: str) -> float:
    value = REGISTRY.get_sample_value("batchinfer_worker_fetch_stalls_total", {"topic": topic})
    return value or 0.0
