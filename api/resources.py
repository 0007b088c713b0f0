"""What the API process holds open for its lifetime, opened and closed by the app's lifespan.

Responsible for: the database engine and session factory, the Kafka producer (connected on
first use, so the API starts, and answers /readyz, while the broker is still coming up;
dropped and re-made in the background when the broker dies and returns),
the Redis clients (sync for publishing, async for long-polls and the rate limiter), and
closing all of them in reverse order.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio as aioredis
import sqlalchemy
from kafka import KafkaProducer
from kafka.errors import KafkaError
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry
from sqlalchemy.orm import Session, sessionmaker

from api.active_jobs import ActiveJobGate
from api.broker_errors import BrokerUnavailable, ServiceStopping
from api.estimates import EstimateBoard
from api.job_writer import JobWriter
from api.key_cache import ApiKeyCache
from api.model_states import ModelStateReader
from api.rate_limit import TokenBucketLimiter
from api.single_flight import SingleFlight
from api.token_budgets import BudgetGate
from core.kafka import ensure_topics, make_producer
from core.settings import Settings
from storage.db import create_db_engine, session_factory
from storage.job_done_hub import JobDoneHub
from storage.model_cards import CardReader

if TYPE_CHECKING:
    from api.auth import CurrentTenant

__all__ = ["BrokerUnavailable", "LazyProducer", "Resources", "ServiceStopping"]

logger = logging.getLogger(__name__)

# Kafka waits (bootstrap, metadata, buffer space) bounded well below a client's patience:
# with the broker down, a submission should get its 503 in seconds, not kafka-python's 60.
PRODUCER_MAX_BLOCK_MS = 5_000
# How long a job's record may take to be acknowledged (acks=all). The producer gives up
# on the record at the same moment the request stops waiting for it, so a record whose
# job was withdrawn (see api.submission) is not delivered later by a retry.
PUBLISH_TIMEOUT_S = 10.0
PRODUCER_REQUEST_TIMEOUT_MS = 5_000
# How often the broker's listener is checked (a loopback TCP connect: cheap). A dead
# broker is noticed this soon, so submissions are refused at once instead of each one
# waiting out PUBLISH_TIMEOUT_S; while it is down, a reconnect is tried as soon as it
# accepts connections again.
BROKER_CHECK_INTERVAL_S = 0.25
BROKER_CONNECT_TIMEOUT_S = 0.5
RECONNECT_MAX_BACKOFF_S = 5.0
# Seconds close() waits for the watcher thread (it never blocks longer than a reconnect).
WATCHER_JOIN_TIMEOUT_S = 10.0
# Seconds the app's shutdown gives each part to close (the producer's flush of records
# already sent fits: PUBLISH_TIMEOUT_S).
CLOSE_TIMEOUT_S = 15.0
# Redis is local and quick; one retry rides out a dropped connection, more only delays
# the fallback (the rate limiter admits, long-polls poll the database).
REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_RETRIES = 1


class LazyProducer:
    """The process's one KafkaProducer, and whether the broker can take jobs right now.

    Responsible for: connecting on first use (and creating the job topics); a watcher
    thread that, from then on, checks the broker still accepts connections, drops the
    producer the moment it does not and connects again in the background once it
    answers; refusing new work for good once the service stops.
    While the broker is down, get() raises BrokerUnavailable without waiting (a request
    whose record was already sent waits for its ack, up to PUBLISH_TIMEOUT_S).
    """

    def __init__(self, settings: Settings,
                 check_interval_s: float = BROKER_CHECK_INTERVAL_S) -> None:
        self._settings = settings
        self._check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._producer: KafkaProducer | None = None
        # Why the broker counts as down (None while it answers or before first use).
        self._down_reason: str | None = None
        self._refusal: str | None = None
        # Held only to decide an answer: `refuse` and `accepting` exclude each other, so
        # once refuse() returns no job is accepted (see api.job_writer).
        self._accept_lock = threading.Lock()
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def unavailable_reason(self) -> str | None:
        """Why jobs are refused right now (broker down, service stopping), else None."""
        return self._refusal or self._down_reason

    @property
    def is_refusing(self) -> bool:
        """Whether jobs are refused because the service is stopping (not a broker fault)."""
        return self._refusal is not None

    def get(self) -> KafkaProducer:
        """The connected producer; BrokerUnavailable at once while jobs cannot be handed over."""
        with self._lock:
            if self._refusal is not None:
                raise ServiceStopping(self._refusal)
            if self._down_reason is not None:
                raise BrokerUnavailable(self._down_reason)
            if self._producer is not None:
                return self._producer
            try:
                self._producer = self._connect()
            except BrokerUnavailable as e:
                self._down_reason = str(e)
                raise
            finally:
                self._start_watcher()
            return self._producer

    def refuse(self, reason: str) -> None:
        """Refuse every later get() with reason (the service is stopping), and every job
        not yet answered: once this returns, no job is accepted (see `accepting`).

        Quick and never waits on the network: a signal handler calls it.
        """
        with self._accept_lock:
            self._refusal = reason
        logger.info("refusing new jobs: %s", reason)

    @contextmanager
    def accepting(self) -> Iterator[str | None]:
        """While held, `refuse` waits: None when a job may be accepted now, else why not.

        The writer answers a job inside it, so checking the refusal and accepting the job
        are one step: a refusal is either before the check (the job is withdrawn and
        refused) or after the answer.
        """
        with self._accept_lock:
            yield self._refusal

    def close(self) -> None:
        """Stop watching, flush pending sends and close the connection, if one was made."""
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(WATCHER_JOIN_TIMEOUT_S)
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is not None:
            _close_producer(producer, PUBLISH_TIMEOUT_S)

    def _connect(self) -> KafkaProducer:
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
        except (KafkaError, ConnectionError) as e:
            raise BrokerUnavailable(f"cannot connect to the broker: {e}") from e
        try:
            # The broker answered, so this is quick. It also restores the topics of a
            # broker that came back empty (the embedded one keeps them in memory).
            ensure_topics(self._settings, timeout_s=PRODUCER_MAX_BLOCK_MS / 1000)
        except (KafkaError, ConnectionError) as e:
            _close_producer(producer, 0)
            raise BrokerUnavailable(f"cannot create the job topics: {e}") from e
        return producer

    def _start_watcher(self) -> None:
        if self._watcher is None and not self._closed.is_set():
            self._watcher = threading.Thread(target=self._watch, name="broker-watch",
                                             daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        # A broker that accepts connections yet fails the connect (still starting, topics
        # refused) is retried less and less often, up to RECONNECT_MAX_BACKOFF_S.
        backoff_s, next_attempt_at = self._check_interval_s, 0.0
        while not self._closed.wait(self._check_interval_s):
            if self._down_reason is None:
                backoff_s, next_attempt_at = self._check_interval_s, 0.0
                if not self._is_reachable():
                    self._mark_down("the broker stopped accepting connections")
            elif time.monotonic() >= next_attempt_at and self._is_reachable():
                if not self._reconnect():
                    backoff_s = min(RECONNECT_MAX_BACKOFF_S, backoff_s * 2)
                    next_attempt_at = time.monotonic() + backoff_s

    def _mark_down(self, reason: str) -> None:
        with self._lock:
            producer, self._producer = self._producer, None
            self._down_reason = reason
        logger.warning("broker unavailable (%s); refusing jobs until it answers", reason)
        if producer is not None:
            # Records already sent keep their delivery timeout: the broker may be back
            # within it (`batchinfer up` restarts its own), and their requests then get a
            # 202; otherwise a 503 that withdraws the job. Closing waits for them, so off
            # this thread; new requests meanwhile get their 503 from get() at once.
            threading.Thread(target=_close_producer, args=(producer, PUBLISH_TIMEOUT_S),
                             name="broker-drop", daemon=True).start()

    def _reconnect(self) -> bool:
        """Connect again; False when the broker still does not take the connection."""
        try:
            producer = self._connect()
        except BrokerUnavailable as e:
            logger.info("broker still unavailable: %s", e)
            return False
        with self._lock:
            if self._closed.is_set():
                self._producer, producer = None, producer
            else:
                self._producer, self._down_reason = producer, None
                producer = None
        if producer is not None:
            _close_producer(producer, 0)  # closed meanwhile: nobody will use it
            return True
        logger.info("broker answers again; accepting jobs")
        return True

    def _is_reachable(self) -> bool:
        """Whether any bootstrap server accepts a TCP connection."""
        for server in self._settings.kafka_bootstrap_servers.split(","):
            host, _, port = server.strip().rpartition(":")
            if not port.isdigit():
                continue
            try:
                with socket.create_connection((host.strip("[]"), int(port)),
                                              timeout=BROKER_CONNECT_TIMEOUT_S):
                    return True
            except OSError:
                continue
        return False


def _close_producer(producer: KafkaProducer, timeout_s: float) -> None:
    try:
        producer.close(timeout=timeout_s)
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
    # Stores and produces submissions in groups (see api.job_writer).
    writer: JobWriter
    # The per-tenant active-job cap (see api.active_jobs).
    active_jobs: ActiveJobGate
    # The workers' model cards, re-read at most every few seconds.
    cards: CardReader
    # Each served model's state (loading, ready, failed) and live workers, read every second.
    model_states: ModelStateReader
    # Live API keys seen lately (see api.key_cache).
    api_keys: ApiKeyCache[CurrentTenant]
    # Wakes long-polls when their job finishes (see storage.job_done_hub).
    done_hub: JobDoneHub
    # Queue positions and ETAs from the last reading of every model's load.
    estimates: EstimateBoard
    # Unix time the app started: the `created` of the models it serves.
    started_at: float = field(default_factory=time.time)
    # Key lookups under way, by key hash, shared by the requests that wait on them.
    key_lookups: SingleFlight[CurrentTenant | None] = field(default_factory=SingleFlight)
    # Active-job counts under way, by tenant id (see api.submission._admit).
    active_counts: SingleFlight[None] = field(default_factory=SingleFlight)
    # Tenants' token budgets (see api.token_budgets); None leaves them unchecked.
    budgets: BudgetGate | None = None

    @classmethod
    def open(cls, settings: Settings) -> Resources:
        """Create every client; none of them connects before first use."""
        engine = create_db_engine(settings.database_url, pool_size=settings.db_pool_size)
        sync_redis = redis.Redis.from_url(settings.redis_url, **_redis_options(Retry))
        async_redis = aioredis.Redis.from_url(settings.redis_url, **_redis_options(AsyncRetry))
        sessions = session_factory(engine)
        api_keys: ApiKeyCache[CurrentTenant] = ApiKeyCache()
        api_keys.listen()
        return cls(
            settings=settings,
            engine=engine,
            sessions=sessions,
            producer=LazyProducer(settings),
            redis=sync_redis,
            aredis=async_redis,
            limiter=TokenBucketLimiter(
                async_redis, prefix=settings.topic_prefix,
                rate_per_s=settings.tenant_rate_limit_per_s,
            ),
            writer=JobWriter(settings, sessions, publish_timeout_s=PUBLISH_TIMEOUT_S),
            active_jobs=ActiveJobGate(settings.tenant_max_active_jobs),
            cards=CardReader(sync_redis, prefix=settings.topic_prefix),
            model_states=ModelStateReader(async_redis, prefix=settings.topic_prefix,
                                          names=settings.served_models,
                                          live_after_s=settings.worker_heartbeat_timeout_s),
            api_keys=api_keys,
            done_hub=JobDoneHub(async_redis, prefix=settings.topic_prefix),
            estimates=EstimateBoard(engine, refresh_s=settings.estimate_refresh_s,
                                    heartbeat_timeout_s=settings.worker_heartbeat_timeout_s),
            budgets=BudgetGate(settings, sessions, async_redis, sync_redis),
        )

    async def aclose(self) -> None:
        """Close in reverse order of use; one failing close does not skip the others.

        Bounded: each part gets CLOSE_TIMEOUT_S at most, so the app's shutdown ends
        whatever a part does (a hung close is logged and left behind on a daemon thread).
        """
        try:
            await self.done_hub.aclose()
        except Exception:
            logger.exception("closing the long-poll hub failed")
        closers = [
            ("API key cache", self.api_keys.close),
            ("job writer", self.writer.close),
            ("kafka producer", self.producer.close),
            ("redis", self.redis.close),
            ("database", self.engine.dispose),
        ]
        for name, close in closers:
            try:
                # Off the event loop: the producer flushes and the pool closes sockets.
                await _run_bounded(close, name=name, timeout_s=CLOSE_TIMEOUT_S)
            except Exception:
                logger.exception("closing the %s failed", name)
        try:
            await asyncio.wait_for(self.aredis.aclose(), CLOSE_TIMEOUT_S)
        except Exception:
            logger.exception("closing the async redis client failed")


async def _run_bounded(call: Callable[[], object], *, name: str, timeout_s: float) -> None:
    """Run a blocking close on a daemon thread of its own, waiting timeout_s at most.

    Not `asyncio.to_thread`: the loop's default executor is joined without a bound when
    the loop closes, so a close stuck there would hang the shutdown all the same.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            call()
        except BaseException as e:  # handed to the awaiting side
            error = e
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:
            pass  # the loop closed meanwhile: nobody waits any more

    threading.Thread(target=run, name=f"close-{name}", daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except TimeoutError:
        logger.warning("closing the %s took over %.0fs; leaving it behind", name, timeout_s)
