"""Wiring one inference worker process: build its parts, run it, tear everything down.

Responsible for: the order of start-up (topics, engine load before joining the consumer
group so a slow load never stalls a rebalance, unless no live worker serves the model,
when the join runs during the load (see early_join); or with engine_urls the engine
servers' client instead, database, the heartbeat, Redis, the cancel
subscription, the consumer), a `finally` for every part started, SIGTERM/SIGINT turning
into a clean drain, and the optional Prometheus exporter.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from contextlib import ExitStack
from types import FrameType

import redis
from prometheus_client import start_http_server

from core.gc_policy import settle_heap
from core.kafka import ensure_topics, make_consumer
from core.settings import Settings, get_settings
from core.topics import Priority
from core.worker_ids import new_worker_id
from storage.db import create_db_engine, session_factory
from storage.events import CancelSubscription
from storage.model_cards import publish_card
from storage.semantic_backends import open_semantic_cache
from workers.engine import EngineConfig, LLMEngine
from workers.engine.embedding_engine import EmbeddingEngine
from workers.engine.embedding_runner import EmbeddingRunner
from workers.engine.model_card import ModelCard, describe_model, model_kind, read_config
from workers.engine.registry import resolve_model
from workers.inference.cache_stats import CacheStatsPublisher
from workers.inference.early_join import EarlyJoin, no_live_worker
from workers.inference.engine_loop import EngineLoop, built_on_a_passing_thread
from workers.inference.heartbeat import Heartbeat
from workers.inference.job_store import JobStore
from workers.inference.kv_tier import connect_kv_tier
from workers.inference.liveness import LoopPulse
from workers.inference.model_presence import ModelPresence, load_recorded
from workers.inference.remote_engine import RemoteEngineLoop
from workers.inference.remote_servers import RemoteEngine, RemoteEngineConfig
from workers.inference.semantic_lookup import SemanticLookup
from workers.inference.service_rate import ServiceRate
from workers.inference.token_publisher import TokenPublisher
from workers.inference.worker import Worker

logger = logging.getLogger(__name__)

# Seconds the engine thread may take to leave its current step at shutdown.
ENGINE_STOP_TIMEOUT_S = 30.0
# Milliseconds the consumer gets to leave its group at shutdown.
CONSUMER_CLOSE_TIMEOUT_MS = 3_000


def build_engine(settings: Settings) -> LLMEngine:
    """The engine for `settings.model`, sized by the `engine_*` settings: the paged-KV
    generator, or for an encoder (an embedding model) the embedding runner behind the
    same add_request / abort / step surface."""
    model_dir = resolve_model(settings.model, settings.models_dir)
    if model_kind(model_dir, read_config(model_dir)) == "embedding":
        runner = EmbeddingRunner(model_dir, device=settings.engine_device,
                                 dtype=settings.engine_dtype,
                                 max_num_batched_tokens=settings.engine_max_num_batched_tokens)
        return EmbeddingEngine(runner)  # type: ignore[return-value]  # same duck surface
    config = EngineConfig(
        model=settings.model,
        models_dir=settings.models_dir,
        dtype=settings.engine_dtype,
        device=settings.engine_device,
        max_num_batched_tokens=settings.engine_max_num_batched_tokens,
        kv_cache_memory_bytes=settings.engine_kv_cache_memory_bytes,
        kv_cache_dtype=settings.engine_kv_cache_dtype,
        step_time_targets=step_time_targets(settings),
        step_slowdowns=step_slowdowns(settings),
        max_prefill_step_time=(None if settings.engine_max_prefill_step_ms is None
                               else settings.engine_max_prefill_step_ms / 1000),
        tenant_max_loss=settings.engine_tenant_max_loss or None,
        quantized_weights=settings.engine_quantized_weights,
    )
    if settings.engine_max_num_seqs is not None:
        config.max_num_seqs = settings.engine_max_num_seqs
    return LLMEngine(config)


def step_time_targets(settings: Settings) -> dict[int, float]:
    """Engine priority value -> target step seconds, from the `engine_step_target_*_ms`."""
    return _by_rank({Priority.HIGH: settings.engine_step_target_high_ms,
                     Priority.NORMAL: settings.engine_step_target_normal_ms,
                     Priority.LOW: settings.engine_step_target_low_ms}, scale=1e-3)


def step_slowdowns(settings: Settings) -> dict[int, float]:
    """Engine priority value -> step slowdown bound, from the `engine_step_slowdown_*`."""
    return _by_rank({Priority.HIGH: settings.engine_step_slowdown_high,
                     Priority.NORMAL: settings.engine_step_slowdown_normal,
                     Priority.LOW: settings.engine_step_slowdown_low})


def _by_rank(values: dict[Priority, float | None], scale: float = 1.0) -> dict[int, float]:
    return {p.rank: v * scale for p, v in values.items() if v is not None}


def announce_model(settings: Settings, redis_client: redis.Redis,
                   remote: RemoteEngine | None = None) -> ModelCard:
    """Describe the served model (kind, context, weights revision) and publish its card."""
    if remote is not None:
        card = remote.card(settings.served_model_name)
    else:
        card = describe_model(resolve_model(settings.model, settings.models_dir),
                              name=settings.served_model_name, cache_dir=settings.models_dir)
    try:
        publish_card(redis_client, prefix=settings.topic_prefix, name=card.name,
                     card=dataclasses.asdict(card))
    except redis.RedisError as e:  # GET /v1/models then lacks its details, nothing else
        logger.warning("cannot publish the card of model %s: %s", card.name, e)
    logger.info("serving %s as %r (%s, revision %s)", card.path, card.name, card.kind,
                card.revision)
    return card


def join_while_loading(settings: Settings) -> EarlyJoin | None:
    """A consumer joining the group while the engine loads, when no live worker serves
    the model (see workers.inference.early_join); None otherwise."""
    # Bounded: a Redis that does not answer costs the early join, never the start.
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2.0,
                                  socket_timeout=2.0)
    try:
        if not no_live_worker(client, prefix=settings.topic_prefix,
                              name=settings.served_model_name,
                              live_after_s=settings.worker_heartbeat_timeout_s):
            return None
    finally:
        client.close()
    return EarlyJoin(make_consumer(settings), list(settings.job_topics.values())).start()


def default_worker_id() -> str:
    """`<host>-<pid>-<token>`: unique per process start, readable in the jobs table, and
    judged dead at once by a process on its host once the pid is gone (core.worker_ids)."""
    return new_worker_id()


def run_worker(settings: Settings | None = None, *, engine: LLMEngine | None = None) -> None:
    """Run one inference worker until SIGTERM/SIGINT (or an engine failure), then drain.

    Returns normally after a clean drain; raises if the engine thread or a dependency
    failed (unfinished jobs are then redelivered to the next worker).
    """
    settings = settings or get_settings()
    if settings.worker_metrics_port:
        start_http_server(settings.worker_metrics_port)
        logger.info("metrics on :%d/metrics", settings.worker_metrics_port)
    ensure_topics(settings)
    # With engine_urls the worker drives those servers instead of loading the model.
    remote = (RemoteEngine(RemoteEngineConfig.from_settings(settings))
              if settings.engine_urls else None)
    joining = (join_while_loading(settings)
               if remote is None and engine is None and settings.worker_join_while_loading
               else None)
    if remote is None:
        # A failed load counts against the model: a few in a row mark it failed (its new
        # jobs refused) rather than leaving its queue to wait on a crash loop.
        # Built on a thread that ends, so that the engine thread's is the only OpenMP team.
        try:
            engine = engine or load_recorded(
                settings, lambda: built_on_a_passing_thread(lambda: build_engine(settings)))
        except BaseException:
            if joining is not None:
                joining.abandon()
                joining.consumer.close(autocommit=False, timeout_ms=CONSUMER_CLOSE_TIMEOUT_MS)
            raise
    with ExitStack() as stack:
        db_engine = create_db_engine(settings.database_url)
        stack.callback(db_engine.dispose)
        worker_id = default_worker_id()
        # Beating before the consumer joins, and stopped (its row deleted) only after
        # the drain handed back what the worker could not finish.
        pulse = LoopPulse()  # the poll loop's; the heartbeat stops when it stalls
        # A remote engine's pace is the server's own.
        rate = ServiceRate(engine.stats) if engine is not None else None
        stack.enter_context(Heartbeat(session_factory(db_engine), worker_id=worker_id,
                                      interval_s=settings.worker_heartbeat_interval_s,
                                      model=settings.served_model_name,
                                      pace=rate.sample if rate is not None else None,
                                      probe_s=settings.worker_pace_probe_s,
                                      pulse=pulse,
                                      loop_stall_timeout_s=settings.worker_loop_stall_timeout_s,
                                      liveness_file=settings.worker_liveness_file))
        redis_client = redis.Redis.from_url(settings.redis_url)
        stack.callback(redis_client.close)
        card = announce_model(settings, redis_client, remote)
        presence = stack.enter_context(ModelPresence(
            redis_client, prefix=settings.topic_prefix, name=card.name, worker_id=worker_id,
            interval_s=settings.worker_heartbeat_interval_s))
        # Attached before the engine thread starts: from then on only that thread uses it.
        kv_tier = (connect_kv_tier(settings, engine, revision=card.revision)
                   if engine is not None else None)
        if kv_tier is not None:
            stack.callback(kv_tier.close)  # after the engine stopped: it writes what is queued
        semantic_cache = open_semantic_cache(
            redis_client, prefix=settings.topic_prefix, backend=settings.semantic_cache_backend,
            max_entries=settings.semantic_cache_max_entries)
        stack.enter_context(CacheStatsPublisher(
            redis_client, prefix=settings.topic_prefix, worker_id=worker_id, model=card.name,
            interval_s=settings.cache_stats_interval_s, kv_tier=kv_tier,
            semantic_backend=semantic_cache.backend))
        settle_heap()  # the engine, model and clients are loaded: what is left is per job
        engine_loop: EngineLoop | RemoteEngineLoop
        if remote is not None:
            engine_loop = RemoteEngineLoop(remote)
        else:
            assert engine is not None
            engine_loop = EngineLoop(engine)
        # Streamed jobs' text: written by its own thread, stopped after the engine's.
        tokens = TokenPublisher(redis_client, prefix=settings.topic_prefix,
                                max_entries=settings.token_stream_max_entries,
                                ttl_s=settings.token_stream_ttl_s)
        tokens.start()
        stack.callback(tokens.stop)
        engine_loop.token_sink = tokens.put
        engine_loop.start()
        stack.callback(engine_loop.stop, ENGINE_STOP_TIMEOUT_S)
        cancels = CancelSubscription(redis_client, prefix=settings.topic_prefix)
        stack.callback(cancels.close)
        consumer = joining.consumer if joining is not None else make_consumer(settings)
        # Offsets were committed by the drain; leaving the group is a courtesy that a dead
        # broker must not turn into a long wait.
        stack.callback(consumer.close, autocommit=False, timeout_ms=CONSUMER_CLOSE_TIMEOUT_MS)
        store = JobStore(
            session_factory(db_engine),
            redis_client,
            prefix=settings.topic_prefix,
            result_cache_ttl_s=settings.result_cache_ttl_s,
            model_revision=card.revision,
            max_tenants=settings.tenant_metrics_max_tenants,
        )
        store.semantic = SemanticLookup(
            semantic_cache,
            models_dir=settings.models_dir, revision=card.revision,
            default_ttl_s=settings.result_cache_ttl_s)
        worker = Worker(
            settings,
            consumer=consumer,
            engine_loop=engine_loop,
            store=store,
            cancels=cancels,
            worker_id=worker_id,
            pulse=pulse,
            joined=joining,
        )
        worker.on_consuming = presence.start  # the model counts this worker from then on
        stack.enter_context(_SignalStop(worker))
        worker.run()
    logger.info("worker stopped cleanly")


class _SignalStop:
    """Route SIGTERM and SIGINT to `worker.request_stop` (main thread only), then restore."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._previous: dict[int, object] = {}

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread; an embedding caller stops us itself
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        logger.info("%s received: draining", signal.Signals(signum).name)
        self._worker.request_stop()
