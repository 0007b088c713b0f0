"""Joining the consumer group during the engine's load, on the real broker and Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import redis
from kafka import ConsumerRebalanceListener, TopicPartition

from core.kafka import ensure_topics, make_consumer, make_producer
from scheduler.embedded_services import free_port
from storage.model_states import beat_worker
from workers.inference.early_join import EarlyJoin, no_live_worker


class _Recorder(ConsumerRebalanceListener):
    """What a worker's listener would be told."""

    def __init__(self) -> None:
        self.assigned: list[set[TopicPartition]] = []

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        pass

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self.assigned.append(set(assigned))


def test_the_join_pauses_what_it_gets_and_hands_it_over_with_every_record(settings) -> None:
    s = settings(topic_partitions=2)
    ensure_topics(s)
    topics = list(s.job_topics.values())
    producer = make_producer(s)
    for i in range(6):
        producer.send(topics[i % len(topics)], key=f"k{i}".encode(), value=f"r{i}".encode())
    producer.flush()
    producer.close()
    consumer = make_consumer(s)
    try:
        joining = EarlyJoin(consumer, topics).start()
        deadline = time.monotonic() + 60
        while not consumer.assignment() and time.monotonic() < deadline:
            time.sleep(0.1)  # the "load": the background poll joins meanwhile
        assigned = set(consumer.assignment())
        assert len(assigned) == 2 * len(topics)
        time.sleep(0.5)  # polls that would fetch, were anything left unpaused
        assert set(consumer.paused()) == assigned

        listener = _Recorder()
        joining.hand_over(listener)
        assert listener.assigned == [assigned] and not consumer.paused()
        assert joining.error is None
        # The positions fetched meanwhile do not matter to a worker (it restarts from the
        # committed offsets); from the beginning, every record is there once.
        consumer.seek_to_beginning(*assigned)
        values: list[bytes] = []
        while len(values) < 6 and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                values += [r.value for r in records]
        assert sorted(values) == sorted(f"r{i}".encode() for i in range(6))
    finally:
        consumer.close(autocommit=False)


def test_a_model_counts_as_served_while_a_worker_beats_for_it(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        prefix = f"early{threading.get_ident()}{time.monotonic_ns()}"
        assert no_live_worker(client, prefix=prefix, name="m", live_after_s=30)
        beat_worker(client, prefix=prefix, name="m", worker_id="w1", now=time.time() - 60)
        assert no_live_worker(client, prefix=prefix, name="m", live_after_s=30)  # long dead
        beat_worker(client, prefix=prefix, name="m", worker_id="w2")
        assert not no_live_worker(client, prefix=prefix, name="m", live_after_s=30)
        assert no_live_worker(client, prefix=prefix, name="other", live_after_s=30)
    finally:
        client.close()
    # Redis away: the worker cannot know, so it joins after its load as a peer would.
    dead = redis.Redis(port=free_port(), socket_connect_timeout=1.0)
    assert not no_live_worker(dead, prefix="p", name="m", live_after_s=30)
