"""Kafka client factories, topic creation and consumer lag, shared by every role.

Producers publish jobs with `acks="all"` keyed by the job's prefix-affinity key; consumers
never auto-commit (workers commit only what they have persisted). `consumer_lag` follows
real Kafka semantics, latest offset − committed offset per partition, so the scheduler
sees the same numbers `kafka-consumer-groups --describe` would print.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError
from kafka.producer.future import FutureRecordMetadata

from core.messages import JobMessage
from core.settings import Settings

logger = logging.getLogger(__name__)

CLIENT_ID = "batchinfer"
# A consumer's longest wait for one broker round trip; see make_consumer.
CONSUMER_REQUEST_TIMEOUT_MS = 5_000


def _bootstrap(settings: Settings) -> list[str]:
    return [s.strip() for s in settings.kafka_bootstrap_servers.split(",") if s.strip()]


def make_producer(settings: Settings, **overrides: object) -> KafkaProducer:
    """A producer that waits for every in-sync replica (`acks="all"`) before a send succeeds."""
    config: dict[str, object] = {
        "bootstrap_servers": _bootstrap(settings),
        "client_id": f"{CLIENT_ID}-producer",
        # A job is written to the database first; losing its record would leave it queued
        # until the reconciler notices, so trade a little latency for durability.
        "acks": "all",
        # Off (kafka-python 3 turns it on with acks=all): a duplicate record is harmless,
        # since workers skip jobs already finished, while an idempotent producer whose
        # broker restarted empty can be left unable to get a producer id, failing every
        # later send (seen with the embedded broker).
        "enable_idempotence": False,
        "retries": 5,
        # No lingering: the callers group records themselves (the API's job writer, the
        # batch fan-out's chunks), and a submission's answer waits for its ack. At 5 ms,
        # one API process accepted 1,207-1,356 submissions/s at 32 in flight against
        # 1,497-1,790 sent at once (bench/RESULTS.md, 2026-11-27).
        "linger_ms": 0,
    }
    config.update(overrides)
    return KafkaProducer(**config)


def publish_job(
    producer: KafkaProducer, settings: Settings, message: JobMessage
) -> FutureRecordMetadata:
    """Produce one job to its model's priority topic, keyed so shared prefixes share a
    partition."""
    topics = settings.job_topics_for(message.model)
    if message.priority not in topics:
        raise ValueError(f"priority must be one of {', '.join(topics)}, got {message.priority!r}")
    return producer.send(
        topics[message.priority],
        key=message.affinity_key(),
        value=message.encode(),
    )


def ensure_topics(settings: Settings, *, timeout_s: float = 30.0) -> None:
    """Create the job topics of every served model (and of this process's own) if missing;
    safe to call from every process at start."""
    deadline = time.monotonic() + timeout_s
    models = dict.fromkeys([*settings.served_models, settings.served_model_name])
    wanted = [topic for model in models for topic in settings.job_topics_for(model).values()]
    admin = _connect_admin(settings, deadline)
    try:
        missing = [t for t in wanted if t not in set(admin.list_topics())]
        if not missing:
            return
        new_topics = [
            NewTopic(
                name=t,
                num_partitions=settings.topic_partitions,
                replication_factor=settings.topic_replication_factor,
            )
            for t in missing
        ]
        try:
            admin.create_topics(new_topics)
            logger.info("created topics %s with %d partitions", missing, settings.topic_partitions)
        except TopicAlreadyExistsError:
            # Another process won the race between list_topics and create_topics.
            logger.debug("topics %s already created by another process", missing)
    finally:
        admin.close()


def _connect_admin(settings: Settings, deadline: float) -> KafkaAdminClient:
    # Processes often start together with the broker; retry until it answers. Its bootstrap
    # and each request (the topic list, their creation) end by the deadline too: with
    # kafka-python's 30 s defaults, an API's first submission waited a minute on a broker
    # slow to answer a 2-core CI run's start, and got a 500 where 503 was due.
    while True:
        wait_ms = int(min(30.0, max(1.0, deadline - time.monotonic())) * 1000)
        try:
            return KafkaAdminClient(
                bootstrap_servers=_bootstrap(settings), client_id=f"{CLIENT_ID}-admin",
                bootstrap_timeout_ms=wait_ms, request_timeout_ms=wait_ms,
            )
        except KafkaError as e:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"Kafka at {settings.kafka_bootstrap_servers} did not answer: {e}"
                ) from e
            logger.info("waiting for Kafka at %s (%s)", settings.kafka_bootstrap_servers, e)
            time.sleep(0.5)


def make_consumer(
    settings: Settings, *, group_id: str | None = None, **overrides: object
) -> KafkaConsumer:
    """An unsubscribed consumer in the workers' group (or `group_id`), auto-commit off."""
    config: dict[str, object] = {
        "bootstrap_servers": _bootstrap(settings),
        "client_id": f"{CLIENT_ID}-consumer",
        "group_id": group_id or settings.consumer_group,
        # At-least-once: offsets are committed by the worker after results are persisted.
        "enable_auto_commit": False,
        # A job produced before any worker joined must still run.
        "auto_offset_reset": "earliest",
        # The engine steps on its own thread, so polls stay frequent; this only bounds how
        # long a wedged worker keeps its partitions.
        "max_poll_interval_ms": 300_000,
        "max_poll_records": 100,
        "session_timeout_ms": settings.kafka_session_timeout_ms,
        # Kafka's advice: heartbeat at most a third of the session timeout.
        "heartbeat_interval_ms": max(100, settings.kafka_session_timeout_ms // 3),
        # How long the broker holds a fetch that finds nothing. Kafka answers it when a
        # record arrives; the embedded broker reads its log again only after sleeping half
        # the wait left; neither answers early for a partition the fetch in flight left out
        # (one still holding fetched records, or paused). So this bounds a record's wait:
        # at 500 ms, 32 jobs in flight through one worker completed 120 a second, not ~380.
        # A worker shortens it while records flow, and lengthens it while it holds seconds
        # of work (workers.inference.fetch_wait).
        "fetch_max_wait_ms": 100,
        # Bounds every round trip (offset commits, close, committed offsets) so a worker
        # facing a dead broker stops in seconds; kafka-python's 30 s default made one
        # shutdown commit block that long. Group joins have their own, longer timeout.
        "request_timeout_ms": CONSUMER_REQUEST_TIMEOUT_MS,
        # Topics come from ensure_topics, with the configured partitions. A consumer
        # reconnecting to a broker that came back empty must not re-create them first
        # with the broker's default partition count.
        "allow_auto_create_topics": False,
    }
    config.update(overrides)
    return KafkaConsumer(**config)


@dataclass(frozen=True, slots=True)
class TopicLag:
    """One topic's lag for one consumer group, and how many partitions the topic has."""

    lag: int
    num_partitions: int


def consumer_lag(
    settings: Settings, *, group_id: str, topics: list[str] | None = None
) -> dict[str, int]:
    """Topic → Σ over partitions of (latest offset − committed offset) for `group_id`.

    A partition the group never committed counts from the log start offset, since workers
    reset to `earliest` and would read all of it. Topics default to the job topics of
    this process's model.
    """
    names = topics if topics is not None else list(settings.job_topics.values())
    consumer = make_consumer(settings, group_id=group_id, client_id=f"{CLIENT_ID}-lag")
    try:
        return {topic: found.lag for topic, found in topic_lag(consumer, names).items()}
    finally:
        consumer.close()


def topic_lag(consumer: KafkaConsumer, topics: list[str]) -> dict[str, TopicLag]:
    """Topic → lag and partition count, for the group of `consumer` (see consumer_lag).

    The consumer need not subscribe (it then never joins the group), so a long-lived one
    can be asked again and again. Every round trip waits at most the consumer's
    request_timeout_ms; kafka-python would wait for an unreachable coordinator forever.
    """
    timeout_ms = consumer.config["request_timeout_ms"]
    partitions: list[TopicPartition] = []
    for topic in topics:
        ids = consumer.partitions_for_topic(topic) or set()
        partitions.extend(TopicPartition(topic, p) for p in sorted(ids))
    lag = dict.fromkeys(topics, 0)
    num_partitions = dict.fromkeys(topics, 0)
    if partitions:
        latest = consumer.end_offsets(partitions)
        earliest = consumer.beginning_offsets(partitions)
        for tp in partitions:
            committed = consumer.committed(tp, timeout_ms=timeout_ms)
            start = committed if committed is not None else earliest[tp]
            lag[tp.topic] += max(0, latest[tp] - start)
            num_partitions[tp.topic] += 1
    return {topic: TopicLag(lag[topic], num_partitions[topic]) for topic in topics}


def fetch_position(consumer: KafkaConsumer, tp: TopicPartition) -> int | None:
    """`consumer.position(tp)`, the offset of the next record the consumer will fetch.

    kafka-python's `position` first refreshes committed offsets, then resets and
    validates positions, each phase over every assigned partition: ~50 us a call on a
    2-core host, and a worker asks for each of its partitions (nine with three
    priorities) on every loop, which at hundreds of loops a second is a tenth of a core.
    The poll runs the same phases before each fetch, so where the partition's state
    holds a position with no reset or validation pending, that position is the answer,
    read from there. Otherwise (no position yet, a reset or validation pending, or
    internals other than kafka-python 3.0's) `position` runs.
    """
    try:
        state = consumer._subscription.assignment[tp]
        if (state.has_valid_position and not state.awaiting_reset
                and not state.awaiting_validation):
            return int(state.position.offset)
    except (AttributeError, KeyError, TypeError):
        pass
    position: int | None = consumer.position(tp)
    return position
