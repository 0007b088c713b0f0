"""Topics for tests that work below the service (a consumer or producer of their own)."""

from __future__ import annotations

from kafka.admin import KafkaAdminClient, NewTopic


def create_topic(bootstrap_servers: str, name: str, num_partitions: int) -> None:
    """Create one topic (replication 1) on the test broker."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers)
    try:
        admin.create_topics([NewTopic(name, num_partitions, 1)])
    finally:
        admin.close()
