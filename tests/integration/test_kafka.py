"""core.kafka against the real broker: idempotent topics, keyed publishing, consumer lag."""

from __future__ import annotations

import threading
import time

from kafka import KafkaAdminClient, TopicPartition
from kafka.structs import OffsetAndMetadata

from core.kafka import (
    consumer_lag,
    ensure_topics,
    fetch_position,
    make_consumer,
    make_producer,
    publish_job,
)
from core.messages import JobMessage


def _message(job_id: str, priority: str, prompt: str) -> JobMessage:
    return JobMessage(
        job_id=job_id,
        tenant_id="ten",
        priority=priority,
        model="m",
        kind="text_completion",
        body={"prompt": prompt},
    )


def test_ensure_topics_is_idempotent_and_uses_the_partition_setting(settings) -> None:
    s = settings(topic_partitions=2)
    ensure_topics(s)
    ensure_topics(s)  # a second process starting: no error, nothing changes
    admin = KafkaAdminClient(bootstrap_servers=s.kafka_bootstrap_servers)
    try:
        described = {
            t["topic"] if "topic" in t else t["name"]: t
            for t in admin.describe_topics(list(s.job_topics.values()))
        }
    finally:
        admin.close()
    assert set(described) == set(s.job_topics.values())
    assert all(len(t["partitions"]) == 2 for t in described.values())


def test_jobs_sharing_a_prompt_prefix_share_a_partition(settings) -> None:
    s = settings(topic_partitions=3, model="m")  # the model of _message
    ensure_topics(s)
    producer = make_producer(s)
    try:
        system = "You are a careful assistant. " * 20  # longer than the affinity prefix
        same = [
            publish_job(producer, s, _message(f"j{i}", "normal", system + f"question {i}"))
            for i in range(6)
        ]
        partitions = {future.get(timeout=30).partition for future in same}
    finally:
        producer.close()
    assert len(partitions) == 1


def test_consumer_lag_is_latest_minus_committed_per_topic(settings) -> None:
    s = settings(topic_partitions=2)
    ensure_topics(s)
    group = f"{s.topic_prefix}.lag"
    high, low = s.job_topics["high"], s.job_topics["low"]
    # batch_size=0: one record per produce request, because the embedded broker's latest
    # offset counts a multi-record batch as one (real Kafka would not care).
    producer = make_producer(s, batch_size=0)
    try:
        for i in range(5):
            producer.send(high, value=b"h%d" % i, partition=0)
        for i in range(3):
            producer.send(low, value=b"l%d" % i, partition=1)
        producer.flush()
    finally:
        producer.close()

    # Nothing committed yet: every record counts (workers start from the earliest offset).
    assert consumer_lag(s, group_id=group) == {high: 5, s.job_topics["normal"]: 0, low: 3}

    committer = make_consumer(s, group_id=group)
    try:
        committer.assign([TopicPartition(high, 0), TopicPartition(low, 1)])
        committer.commit(
            {
                TopicPartition(high, 0): OffsetAndMetadata(2, "", -1),
                TopicPartition(low, 1): OffsetAndMetadata(3, "", -1),
            }
        )
    finally:
        committer.close()
    assert consumer_lag(s, group_id=group) == {high: 3, s.job_topics["normal"]: 0, low: 0}
    # Another group's commits are its own.
    assert consumer_lag(s, group_id=f"{group}.other")[high] == 5


def test_a_partition_paused_mid_backlog_is_drained_after_resume(settings) -> None:
    """A worker pauses a partition when its prefetch fills and resumes it later: every
    record behind the pause must still arrive (kafka-python could park them for good)."""
    from workers.inference.priority import _apply

    s = settings(topic_partitions=1, model="m")  # the model of _message
    ensure_topics(s)
    topic = s.job_topics["low"]
    tp = TopicPartition(topic, 0)
    producer = make_producer(s)
    try:
        for i in range(20):
            publish_job(producer, s, _message(f"job_{i}", "low", "x" * 800))
        producer.flush(10)
        consumer = make_consumer(
            s, group_id=f"{s.topic_prefix}.park", max_poll_records=100, fetch_max_wait_ms=100
        )
        consumer.subscribe([topic])
        try:
            offsets: list[int] = []

            def poll_into(until: int, seconds: float) -> None:
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline and len(offsets) < until:
                    for records in consumer.poll(100).values():
                        offsets.extend(r.offset for r in records)

            poll_into(20, 30)
            _apply(consumer, {tp}, {tp})
            for i in range(20, 320):
                publish_job(producer, s, _message(f"job_{i}", "low", "x" * 800))
            producer.flush(10)
            time.sleep(0.5)
            _apply(consumer, {tp}, set())
            poll_into(21, 20)  # one poll's worth, then the backlog is still there
            _apply(consumer, {tp}, {tp})
            for _ in range(5):
                consumer.poll(50)
            _apply(consumer, {tp}, set())
            poll_into(320, 20)
        finally:
            consumer.close()
    finally:
        producer.close()
    assert sorted(offsets) == list(range(320))


def test_fetch_position_is_the_consumers_position_through_polls_and_seeks(settings) -> None:
    """Read from the partition's state once it has a position, the consumer's own answer
    before (no position yet: `position` runs its refresh), after each poll and after a
    seek, on every partition."""
    s = settings(topic_partitions=2, model="m")  # the model of _message
    ensure_topics(s)
    topic = s.job_topics["normal"]
    producer = make_producer(s)
    consumer = make_consumer(s, group_id=f"{s.topic_prefix}.position", max_poll_records=7)
    try:
        for i in range(40):
            publish_job(producer, s, _message(f"job_{i}", "normal", f"prompt {i}"))
        producer.flush(10)
        tps = [TopicPartition(topic, 0), TopicPartition(topic, 1)]
        consumer.assign(tps)
        real_position = consumer.position
        slow_calls: list[TopicPartition] = []

        def counted_position(tp: TopicPartition, timeout_ms: int | None = None) -> int | None:
            slow_calls.append(tp)
            return real_position(tp, timeout_ms)

        consumer.position = counted_position  # type: ignore[method-assign]
        assert [fetch_position(consumer, tp) for tp in tps] == [0, 0]  # refreshed: earliest
        assert slow_calls[:1] == tps[:1]  # its refresh gave every partition a position
        seen = 0
        deadline = time.monotonic() + 30
        while seen < 40 and time.monotonic() < deadline:
            seen += sum(len(records) for records in consumer.poll(200).values())
            slow_calls.clear()
            fast = [fetch_position(consumer, tp) for tp in tps]
            assert not slow_calls, "a known position is read without the refresh"
            assert fast == [real_position(tp) for tp in tps]
        assert seen == 40 and sum(p or 0 for p in fast) == 40
        consumer.seek(tps[0], 3)
        assert fetch_position(consumer, tps[0]) == real_position(tps[0]) == 3
    finally:
        consumer.close()
        producer.close()


def test_a_record_arriving_while_an_idle_worker_polls_ends_the_poll(settings) -> None:
    """An idle worker polls for up to IDLE_POLL_TIMEOUT_MS at a time: a record produced
    meanwhile is returned within the consumer's fetch wait, not when the poll times out."""
    from workers.inference.loop_pacing import IDLE_POLL_TIMEOUT_MS

    s = settings(topic_partitions=3, model="m")  # the model of _message
    ensure_topics(s)
    producer = make_producer(s)
    consumer = make_consumer(s, group_id=f"{s.topic_prefix}.wait")
    topic = s.job_topics["normal"]
    consumer.subscribe([topic])
    sent_at: list[float] = []

    def produce(i: int) -> None:
        sent_at.append(time.monotonic())
        publish_job(producer, s, _message(f"wait_{i}", "normal", f"prompt {i}")).get(10)

    try:
        deadline = time.monotonic() + 30
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(100)
        for _ in range(3):
            consumer.poll(200)  # past the first fetches
        waits = []
        for i in range(5):
            timer = threading.Timer(0.1 + 0.05 * i, produce, args=(i,))
            timer.start()  # fires while the poll below waits
            while not any(consumer.poll(IDLE_POLL_TIMEOUT_MS).values()):
                assert time.monotonic() < deadline + 30, "the record never arrived"
            timer.join()
            waits.append(time.monotonic() - sent_at[-1])
    finally:
        consumer.close()
        producer.close()
    fetch_wait_s = consumer.config["fetch_max_wait_ms"] / 1000
    assert fetch_wait_s < IDLE_POLL_TIMEOUT_MS / 1000 / 2
    assert max(waits) < IDLE_POLL_TIMEOUT_MS / 1000 / 2, waits
