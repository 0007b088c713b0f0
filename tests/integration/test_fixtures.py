"""The integration fixtures give working PostgreSQL, Redis and broker endpoints."""

from __future__ import annotations

import uuid

import redis
import sqlalchemy as sa
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from core.settings import get_settings


def test_postgres_database_is_fresh_and_writable(postgres_url: str) -> None:
    """Each test gets its own empty database it can write to."""
    engine = sa.create_engine(postgres_url)
    try:
        with engine.begin() as conn:
            assert conn.execute(sa.text(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema='public'"
            )).scalar_one() == 0
            conn.execute(sa.text("CREATE TABLE t (x int)"))
            conn.execute(sa.text("INSERT INTO t VALUES (1)"))
    finally:
        engine.dispose()


def test_redis_answers(redis_url: str) -> None:
    """The Redis server stores and returns a value."""
    client = redis.Redis.from_url(redis_url)
    key = f"fixture-{uuid.uuid4().hex}"
    client.set(key, b"1", ex=10)
    assert client.get(key) == b"1"
    client.close()


def test_broker_creates_topics(kafka_bootstrap: str) -> None:
    """The broker accepts topic creation and lists the topic."""
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    name = f"fixture-{uuid.uuid4().hex[:8]}"
    try:
        admin.create_topics([NewTopic(name, num_partitions=2, replication_factor=1)])
        assert name in admin.list_topics()
    finally:
        admin.close()


def test_settings_factory_points_at_the_services(settings, postgres_url, redis_url,
                                                 kafka_bootstrap) -> None:
    """The settings factory wires the test's services and a fresh prefix, env included."""
    s = settings(worker_max_inflight=7)
    assert s.database_url == postgres_url
    assert s.redis_url == redis_url
    assert s.kafka_bootstrap_servers == kafka_bootstrap
    assert s.worker_max_inflight == 7
    assert s.topic_prefix.startswith("t")
    assert get_settings() == s
