"""What the API process holds open for its lifetime, opened and closed by the app's lifespan.

Responsible for: the database engine and session factory, the Kafka producer (connected on
first use, so the API starts, and answers /readyz, while the broker is still coming up),
the Redis clients (sync for publishing and the rate limiter, async for long-polls), and
closing all of them in reverse order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
import sqlalchemy
from kafka import KafkaProducer
from kafka.errors import KafkaError
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry
from sqlalchemy.orm import Session, sessionmaker

from api.rate_limit import TokenBucketLimiter
from core.kafka import ensure_topics, make_producer
from core.settings import Settings
from storage.db import create_db_engine, session_factory

logger = logging.getLogger(__name__)

# Kafka waits (bootstrap, metadata, buffer space) bounded well below a client's patience:
# with the broker down, a submission should get its 503 in seconds, not kafka-python's 60.
PRODUCER_MAX_BLOCK_MS = 5_000
# How long a job's record may take to be acknowledged (acks=all). The producer gives up
# on the record at the same moment the request stops waiting for it, so a record whose
# job was withdrawn (see api.submission) is not delivered later by a retry.
PUBLISH_TIMEOUT_S = 10.0
PRODUCER_REQUEST_TIMEOUT_MS = 5_000
# After a failed connect, fail fast for this long instead of every request waiting out
# another bootstrap timeout in turn.
RECONNECT_BACKOFF_S = 2.0
# Redis is local and quick; one retry rides out a dropped connection, more only delays
# the fallback (the rate limiter admits, long-polls poll the database).
REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_RETRIES = 1


class BrokerUnavailable(ConnectionError):
    """The Kafka producer could not be created (broker down or unreachable)."""


class LazyProducer:
    """The process's one KafkaProducer, created on first use and retried after failures."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._producer: KafkaProducer | None = None
        self._failed_at: float | None = None

    def get(self) -> KafkaProducer:
        """The connected producer; BrokerUnavailable if the broker cannot be reached."""
        with self._lock:
            if self._producer is not None:
                return self._producer
            if self._failed_at is not None and time.monotonic() - self._failed_at < (
                RECONNECT_BACKOFF_S
            ):
                raise BrokerUnavailable("the last connection attempt failed moments ago")
            try:
                producer = make_producer(
                    self._settings,
                    bootstrap_timeout_ms=PRODUCER_MAX_BLOCK_MS,
                    max_block_ms=PRODUCER_MAX_BLOCK_MS,
                    request_timeout_ms=PRODUCER_REQUEST_TIMEOUT_MS,
                    delivery_timeout_ms=int(PUBLISH_TIMEOUT_S * 1000),
                    # Topics come from ensure_topics, with the configured partitions; an
                    # auto-created one would get the broker's default instead.
                    allow_auto_create_topics=False,
                )
                # The broker answered, so this is quick; without it a first publish to a
                # missing topic could auto-create it with the broker's default partitions.
                ensure_topics(self._settings, timeout_s=PRODUCER_MAX_BLOCK_MS / 1000)
            except (KafkaError, ConnectionError) as e:
                self._failed_at = time.monotonic()
                raise BrokerUnavailable(str(e)) from e
            self._producer = producer
            self._failed_at = None
            return producer

    def close(self) -> None:
        """Flush pending sends and close the connection, if one was made."""
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.close(timeout=PUBLISH_TIMEOUT_S)
        except KafkaError as e:
            # Only records already given up on (their requests got a 503) can be pending.
            logger.warning("kafka producer closed with unsent records: %s", e)


def _redis_options(retry_class: type[Retry] | type[AsyncRetry]) -> dict[str, Any]:
    """Fail fast: redis-py's default retries a refused connection for ~4 s per command."""
    backoff = ExponentialWithJitterBackoff(base=0.01, cap=0.1)
    return {
        "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
        "retry": retry_class(backoff, REDIS_RETRIES),
    }


@dataclass(slots=True)
class Resources:
    """Connections the routes share; built once per app in its lifespan."""

    settings: Settings
    engine: sqlalchemy.Engine
    sessions: sessionmaker[Session]
    producer: LazyProducer
    redis: redis.Redis
    aredis: aioredis.Redis
    limiter: TokenBucketLimiter
    # Unix time the app started: the `created` of the models it serves.
    started_at: float = field(default_factory=time.time)

    @classmethod
    def open(cls, settings: Settings) -> Resources:
        """Create every client; none of them connects before first use."""
        engine = create_db_engine(settings.database_url)
        sync_redis = redis.Redis.from_url(settings.redis_url, **_redis_options(Retry))
        return cls(
            settings=settings,
            engine=engine,
            sessions=session_factory(engine),
            producer=LazyProducer(settings),
            redis=sync_redis,
            aredis=aioredis.Redis.from_url(settings.redis_url, **_redis_options(AsyncRetry)),
            limiter=TokenBucketLimiter(
                sync_redis, prefix=settings.topic_prefix,
                rate_per_s=settings.tenant_rate_limit_per_s,
            ),
        )

    async def aclose(self) -> None:
        """Close in reverse order of use; one failing close does not skip the others."""
        closers = [
            ("kafka producer", self.producer.close),
            ("redis", self.redis.close),
            ("database", self.engine.dispose),
        ]
        for name, close in closers:
            try:
                # Off the event loop: the producer flushes and the pool closes sockets.
                await asyncio.to_thread(close)
            except Exception:
                logger.exception("closing the %s failed", name)
        try:
            await self.aredis.aclose()
        except Exception:
            logger.exception("closing the async redis client failed")
