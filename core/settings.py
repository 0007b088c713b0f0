"""Settings for every role, from `BATCHINFER_*` environment variables (and `.env`).

Read them through `get_settings()`; tests override with `get_settings.cache_clear()` and
environment variables. Nothing here is built at import time.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from core.topics import consumer_group_name, job_topic_names


class Settings(BaseSettings):
    """One typed view of the configuration; unsafe values fail at start-up."""

    model_config = SettingsConfigDict(env_prefix="BATCHINFER_", env_file=".env", extra="ignore")

    # Where the embedded default keeps its SQLite file, Redis dump, broker and files.
    data_dir: Path = Path(".data")
    # Empty: sqlite under data_dir. Production: postgresql+psycopg://user:pw@host/db
    database_url: str = ""
    # Database connections an API process keeps open: as many as its thread pool runs
    # database calls at once (anyio's 40). Beyond the pool a connection is opened and
    # closed per use; with SQLAlchemy's default of 5, 32 concurrent long-polls spent a
    # third of the API's time opening SQLite connections and queueing for them. With
    # PostgreSQL keep api_processes x this (+ 10 overflow each) under max_connections.
    db_pool_size: int = Field(default=40, ge=1)
    kafka_bootstrap_servers: str = "127.0.0.1:9092"
    topic_prefix: str = "batchinfer"
    topic_partitions: int = Field(default=3, ge=1)
    topic_replication_factor: int = Field(default=1, ge=1)
    # A crashed worker's partitions move to the others after this long; the embedded broker
    # also takes about half of it to complete a group join.
    kafka_session_timeout_ms: int = Field(default=10_000, ge=1000)
    redis_url: str = "redis://127.0.0.1:6379/0"

    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=1, le=65535)
    # API processes `batchinfer up` serves the port with (one interpreter tops out at about
    # one core); above 1 they share it through SO_REUSEPORT.
    api_processes: int = Field(default=1, ge=1, le=64)
    # Bind the API's port with SO_REUSEPORT so several API processes share it (Linux
    # spreads connections among them); `up` sets it for its own API processes.
    api_reuse_port: bool = False
    # Largest accepted request body, bytes (413 above it).
    max_request_bytes: int = Field(default=1_048_576, ge=1024)
    # Seconds a request body may pause mid-way before the request is answered 408.
    api_body_read_timeout_s: float = Field(default=30.0, gt=0)
    # Jobs a tenant may have queued or running at once (429 above it).
    tenant_max_active_jobs: int = Field(default=100_000, ge=1)
    # Submissions per tenant per second (token bucket; 429 above it).
    tenant_rate_limit_per_s: float = Field(default=1000.0, gt=0)
    # Tenants' token budgets (`batchinfer tenants set-limits`): how long an API process or
    # the scheduler trusts the limits it read, and the output tokens a job without
    # `max_tokens` is expected to use when its reservation is made (settled when it ends).
    tenant_limits_refresh_s: float = Field(default=5.0, gt=0)
    budget_default_completion_tokens: int = Field(default=256, ge=1)
    # Prometheus series per tenant before further tenants are counted as "other".
    tenant_metrics_max_tenants: int = Field(default=50, ge=1)
    long_poll_max_s: float = Field(default=60.0, ge=0)
    # How long OpenAI-compatible /v1/chat/completions waits for its job.
    sync_request_timeout_s: float = Field(default=600.0, gt=0)
    # Streamed jobs' token streams in Redis (storage.token_streams): entries kept per job
    # (a step's text is one entry, so this bounds a runaway job, not a normal one) and how
    # long a stream outlives its last write, for followers that arrive late.
    token_stream_max_entries: int = Field(default=10_000, ge=16)
    token_stream_ttl_s: int = Field(default=600, ge=1)

    # The model a worker loads (a known name, a Hugging Face directory or a .gguf file),
    # the name clients ask for it by (default: `model` itself), and the names the API
    # accepts (default: that one). Each served model has its own job topics and group.
    model: str = "smollm2-135m-instruct"
    served_model_name: str = ""
    served_models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Served names that are embedding models (POST /v1/embeddings); the rest generate.
    embedding_models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    models_dir: Path = Path.home() / ".cache" / "batchinfer" / "models"

    # Inference worker: jobs taken from Kafka and not yet finished, at most. None: twice
    # the engine's max_num_seqs, so the places a finished step frees are refilled from jobs
    # at hand while the next step runs. (A fixed 128 beside a 64-sequence batch held a
    # worker of 1-token jobs to steps of ~55 jobs and a store, a claim and a broker poll per
    # step: bench/RESULTS.md, 2026-11-27 eighth stop.)
    worker_max_inflight: int | None = Field(default=None, ge=1)
    # The same for a worker of an embedding model: an encoder keeps nothing per job
    # between steps, and more jobs at hand sort into fuller batches. Over the embeddings
    # bench's 10,000 texts (`python -m bench.embedding_padding`) batches from 4,096 held
    # pad 2.26% against 1.26% for one sort of all, from 8,192 held 1.31%.
    embedding_worker_max_inflight: int = Field(default=8192, ge=1)
    # Sequences in the engine's running batch, at most. None: the engine's default, 256 as
    # vLLM's (on the CPU a step is also bounded by its token budget and the KV pool).
    engine_max_num_seqs: int | None = Field(default=None, ge=1)
    # None: the engine's default for its device (workers/engine/config.py).
    engine_max_num_batched_tokens: int | None = Field(default=None, ge=1)
    engine_kv_cache_memory_bytes: int | None = None
    # What the KV cache stores: the model's dtype ("auto"), or e4m3 bytes ("fp8", as
    # vLLM's --kv-cache-dtype fp8): twice the sequences of a bf16 pool in the same memory.
    engine_kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    engine_dtype: str = "auto"
    engine_device: str = "auto"
    # A quantized checkpoint's projections: kept quantized on CUDA ("auto"), always
    # ("packed") or dequantized at load ("dequantize"); see docs/models.md.
    engine_quantized_weights: Literal["auto", "packed", "dequantize"] = "auto"
    # Engine servers: with URLs (`http://host:port/v1`, one per server of the same model),
    # the worker drives those OpenAI-compatible servers (vLLM, SGLang, TGI, llama.cpp)
    # instead of loading `model`, which is then the name the servers know it by. See
    # docs/engine-servers.md.
    engine_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Requests one server runs at once; the worker keeps twice the sum of them in flight
    # (unless worker_max_inflight says otherwise), the rest waiting most urgent first.
    engine_url_concurrency: int = Field(default=32, ge=1)
    # Sent as `Authorization: Bearer ...` (vLLM's --api-key), when set.
    engine_url_api_key: str | None = None
    # A request the server has not answered in this long fails its job.
    engine_url_timeout_s: float = Field(default=600.0, gt=0)
    # Send vLLM's `priority` (0 high, 1 normal, 2 low: lower runs first). vLLM refuses it
    # unless started with `--scheduling-policy priority`, so it is off unless asked for.
    engine_url_send_priority: bool = False
    # A server answering 429/503 or dropping connections is left alone this long after its
    # first failure, doubling per failure in a row up to the maximum (with jitter), unless
    # it says how long itself (Retry-After); its jobs wait or go to another server.
    engine_url_backoff_s: float = Field(default=0.5, gt=0)
    engine_url_backoff_max_s: float = Field(default=30.0, gt=0)
    # Latency classes: the longest a decode step may take while it holds a job of this
    # priority; less urgent jobs sit steps out (keeping their KV) to keep it. None: no
    # target. The engine prices steps with a cost model fitted from its own steps, so
    # these hold on any device; a target below what the urgent work alone costs just
    # runs that work alone.
    engine_step_target_high_ms: float | None = Field(default=40.0, gt=0)
    # 100 ms for `normal`: at 250 a tenant's 50 normal jobs behind another's 5,000-line low
    # batch took 2.32x their idle time on SmolLM2 (CPU), at 100 1.27x, the batch's loss
    # within the drift between two runs of it alone (bench.tenant_fairness).
    engine_step_target_normal_ms: float | None = Field(default=100.0, gt=0)
    engine_step_target_low_ms: float | None = Field(default=None, gt=0)
    # And relative to the device and model: a step holding a job of this priority may
    # take this many times what its own (and any more urgent) work alone costs. A target
    # in ms binds only where full steps are slower than it: on the tiny model a 256-wide
    # step took ~15 ms, under the 40 ms `high` target, and a high job ran 17-21x its time
    # alone; at 1.0 it ran as fast as alone (0.99x), the low batch at 99% of its pace
    # (bench.priority_latency). Above 1.0 low work shares those steps as the cost model
    # prices them; at 1.1-1.5 the tiny model's high job ran 1.5-2.5x its time alone, the
    # fitted cost being least exact at a step's narrowest widths. None: no bound.
    engine_step_slowdown_high: float | None = Field(default=1.0, ge=1)
    engine_step_slowdown_normal: float | None = Field(default=None, ge=1)
    engine_step_slowdown_low: float | None = Field(default=None, ge=1)
    # The longest the prefill work of one step may add to it (priced by the same cost model).
    # A job arriving mid-step waits for that step, whatever its priority: on a 2-core CPU
    # a 2,048-token step of SmolLM2 prefill took ~25 s under load. None: the token budget
    # alone sizes the step. Decodes are never held back for it.
    engine_max_prefill_step_ms: float | None = Field(default=2000.0, gt=0)
    # Within a priority, while tenants over their weighted share of its running jobs run
    # beside tenants under it, the over-share tenants' jobs beyond one sit steps out
    # (keeping their KV) so the others' tokens are not paced by a big batch; the cap is set
    # from the engine's cost model so that they lose at most this fraction of their
    # throughput over a long run (a short burst of the others' may take its fair share of
    # step time first; docs/tenants.md). 0 (the default): no cap. Off by default: the cap
    # prices the over-share tenants' decodes before the step's admissions, so where their
    # admitted prefill sets the step time (a batch of short lines) it holds their decodes
    # back for little gain and the loss it charges them is understated.
    engine_tenant_max_loss: float = Field(default=0.0, ge=0, lt=1)
    # API: how often the load behind queue positions and ETAs is read again (once per
    # process, whatever the number of readers).
    estimate_refresh_s: float = Field(default=1.0, gt=0)
    # Prometheus exporter port of the worker process (0: off).
    worker_metrics_port: int = Field(default=0, ge=0, le=65535)
    # On SIGTERM, how long in-flight jobs may take to finish before the worker exits anyway.
    worker_drain_timeout_s: float = Field(default=30.0, ge=0)
    # A partition silent this long while records wait beyond the consumer's position is
    # restarted from its committed offset (a fetch stall; see workers/inference/stall_watchdog).
    worker_stall_after_s: float = Field(default=15.0, gt=0)
    # Liveness: each worker stamps its row in the `workers` table this often. One silent
    # for worker_heartbeat_timeout_s counts as dead: the reconciler hands its running jobs
    # back to the queue, or fails those that have had job_max_attempts claims already.
    worker_heartbeat_interval_s: float = Field(default=5.0, gt=0)
    worker_heartbeat_timeout_s: float = Field(default=30.0, gt=0)
    # Between beats, the worker looks at its pace this often and beats at once when it is
    # news (known at last, or moved by a quarter): estimates read the last beat's.
    worker_pace_probe_s: float = Field(default=0.25, gt=0)
    # A worker whose poll loop has not gone round for this long stops beating (and is then
    # replaced as a dead one): a hung loop must not hide behind a healthy heartbeat thread.
    worker_loop_stall_timeout_s: float = Field(default=60.0, gt=0)
    # Touched with every beat (see workers/inference/liveness): its age is what the
    # supervisor and the Kubernetes probes judge a worker alive by. None: no file.
    worker_liveness_file: Path | None = None
    # `up` forks its workers, its extra API processes and its model check from a server
    # that has imported torch, transformers and the engine once (scheduler/warm_start): a
    # restart or scale-up starts in well under a second instead of 4-10 s of imports.
    # False: a fresh interpreter each.
    worker_warm_start: bool = True
    # A worker of a model no live worker serves joins its consumer group while its engine
    # loads (its partitions paused until then), so the group join (seconds: see
    # kafka_session_timeout_ms) is not added to the first job's wait. A worker joining
    # live peers always joins after its load, so it never holds their partitions through it.
    worker_join_while_loading: bool = True
    job_max_attempts: int = Field(default=3, ge=1)
    result_cache_ttl_s: int = Field(default=86_400, ge=0)
    # Semantic cache search: `auto` takes Redis vector search (HNSW) when the server has
    # the search module, else the exact numpy scan; `hnsw` or `exact` insist on one.
    semantic_cache_backend: Literal["auto", "hnsw", "exact"] = "auto"
    # Exact scan only: entries one scope (tenant, model, revision, sampling) keeps at most,
    # oldest dropped first; a lookup scans them all (17-25 ms at 100,000 here: bench/RESULTS).
    semantic_cache_max_entries: int = Field(default=100_000, ge=128)  # >= one chunk
    # Prefix KV tier in Redis: full prefix blocks a worker's pool evicts or reuses are kept
    # there (by chain hash, model revision and tenant) for every worker of the model to
    # load instead of recomputing. Off by default: a block of a 135M model is ~0.4 MB.
    kv_tier_enabled: bool = False
    # Empty: redis_url. A separate server keeps bulky KV away from queues and results.
    kv_tier_redis_url: str = ""
    kv_tier_ttl_s: int = Field(default=3600, ge=1)
    # Bytes the tier may hold per model revision, all workers together (oldest go first).
    kv_tier_max_bytes: int = Field(default=1 << 30, ge=1)
    # Store each block once computed, not only when reused or evicted: more Redis
    # traffic, but other workers find a prefix as soon as one worker computed it.
    kv_tier_write_through: bool = False
    # A Redis call slower than this counts as an outage: the tier is bypassed a while.
    kv_tier_timeout_s: float = Field(default=0.5, gt=0)
    # How often workers publish their cache counters for GET /v1/cache/stats.
    cache_stats_interval_s: float = Field(default=5.0, gt=0)

    # Reconciler: re-publish jobs still queued after this long.
    requeue_after_s: float = Field(default=300.0, gt=0)
    # Prometheus exporter port of the scheduler role (`batchinfer reconcile`; 0: off).
    scheduler_metrics_port: int = Field(default=0, ge=0, le=65535)

    # Autoscaler: the worker count follows the workers' consumer lag (`batchinfer up
    # --max-workers`; on a cluster the KEDA ScaledObject in deploy/kubernetes/ uses the same
    # numbers). Fewest and most workers; it never asks for more than the job topics have
    # partitions (a worker beyond them would idle), unless the minimum itself is higher.
    autoscale_min_workers: int = Field(default=1, ge=0)
    autoscale_max_workers: int = Field(default=3, ge=1)
    # Weighted lag one worker is meant to absorb. Below the default every waiting job fits
    # in a quarter of one worker's default in-flight window (2 x 256).
    autoscale_lag_threshold: int = Field(default=128, ge=1)
    # Scale-down waits until the lag has asked for fewer workers this long; scale-up does
    # not wait. Longer than a worker's start (model load), so a lull between bursts does
    # not drain a worker that the next burst needs again.
    autoscale_cooldown_s: float = Field(default=60.0, ge=0)
    # How often the lag is read.
    autoscale_interval_s: float = Field(default=5.0, gt=0)
    # Lag weight per priority, normal being the unit of autoscale_lag_threshold. High jobs
    # are mostly OpenAI-compatible calls with a client waiting on them; low ones are
    # batches with a 24 h window, which may arrive 50,000 at a time.
    autoscale_weight_high: float = Field(default=4.0, gt=0)
    autoscale_weight_normal: float = Field(default=1.0, gt=0)
    autoscale_weight_low: float = Field(default=0.25, gt=0)

    # Files and batches (OpenAI-compatible). Files live under files_dir (default
    # data_dir/files); the limits default to OpenAI's.
    files_dir: Path | None = None
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1)
    batch_max_requests: int = Field(default=50_000, ge=1)
    # Accepted `completion_window` values ("<n>s|m|h|d"); tests add short ones.
    batch_completion_windows: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["24h"]
    )
    # Longest wait between batch passes (validate, fan out, count, finalize); announced
    # batches and batches about to finish bring a pass sooner.
    batch_poll_interval_s: float = Field(default=1.0, gt=0)
    # Batch lines queued in the topics at once per model and priority, all batches together
    # (0: no window). Lines past it wait in their input files, shared by tenant weight and
    # then by deadline (scheduler.fanout_plan), so another tenant's jobs of the same
    # priority are never queued behind more than this many batch lines (fair share,
    # docs/tenants.md). Keep it above what the fleet runs at once (workers x
    # worker_max_inflight), or the batches cannot use it all.
    batch_max_queued_lines: int = Field(default=2000, ge=0)

    # Webhook callbacks (`batchinfer callbacks`, a Celery worker on redis_url).
    # Hosts or CIDRs a callback URL may resolve into although private (e.g. 127.0.0.1).
    webhook_allowlist: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Tenants (by name or id) whose keys see service-wide views, such as every worker's
    # cache counters; other tenants see their own figures only.
    admin_tenants: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Seconds before each retry; its length is the number of retries (~3 days in all).
    webhook_retry_schedule: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0],
        min_length=1,
    )
    webhook_connect_timeout_s: float = Field(default=5.0, gt=0)
    # Whole attempt (connect, send, response): a slow receiver cannot hold a worker longer.
    webhook_timeout_s: float = Field(default=15.0, gt=0)
    webhook_max_response_bytes: int = Field(default=4096, ge=0)
    # A claimed delivery is re-dispatched after this long (a crashed worker's claim).
    webhook_claim_s: float = Field(default=60.0, gt=0)
    webhook_concurrency: int = Field(default=8, ge=1)
    # How often the dispatcher beat looks for due deliveries (tests shorten it).
    webhook_dispatch_interval_s: float = Field(default=1.0, gt=0, le=1.0)
    # Port of the callbacks role's Prometheus endpoint; 0 turns it off.
    webhook_metrics_port: int = Field(default=0, ge=0, le=65535)

    # `batchinfer up`: seconds before restarting an embedded broker or Redis that died;
    # doubled for each crash soon after a restart, up to 30 s.
    embedded_restart_backoff_s: float = Field(default=0.5, ge=0, le=30)

    log_level: str = "INFO"
    # uvicorn's access log, one line per HTTP request. Off unless asked for: at thousands
    # of submissions and long-polls a second it is a line formatted and written per
    # request on the API's one event loop, and batchinfer_http_request_seconds already
    # counts every request by route and status.
    api_access_log: bool = False
    # The most bytes of a request's line and headers the API reads; past it, 431 and the
    # connection closed (api.http_limits). 64 KiB holds any real token or cookie.
    api_max_head_bytes: int = Field(default=64 * 1024, ge=1024)
    # Seconds a request's line and headers may take to arrive; past them, 408 and the
    # connection closed (a client that opens connections and never finishes a request).
    api_head_timeout_s: float = Field(default=30.0, gt=0)

    @field_validator(
        "served_models",
        "embedding_models",
        "engine_urls",
        "batch_completion_windows",
        "webhook_allowlist",
        "webhook_retry_schedule",
        "admin_tenants",
        mode="before",
    )
    @classmethod
    def _split_list(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [item.strip() for item in text.split(",") if item.strip()]
        return value

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.data_dir / 'batchinfer.db').resolve()}"
        if not self.served_model_name:
            self.served_model_name = self.model
        if not self.served_models:
            self.served_models = [self.served_model_name]
        if self.files_dir is None:
            self.files_dir = self.data_dir / "files"
        if self.webhook_claim_s <= self.webhook_timeout_s:
            raise ValueError("webhook_claim_s must exceed webhook_timeout_s, or a slow "
                             "delivery would be claimed again while still in flight")
        if any(delay < 0 for delay in self.webhook_retry_schedule):
            raise ValueError("webhook_retry_schedule holds seconds, none negative")
        if self.worker_heartbeat_timeout_s < 2 * self.worker_heartbeat_interval_s:
            raise ValueError(
                f"worker_heartbeat_timeout_s ({self.worker_heartbeat_timeout_s}) must be at "
                f"least twice worker_heartbeat_interval_s ({self.worker_heartbeat_interval_s}), "
                "or one late beat would declare a live worker dead and re-run its jobs")
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine_urls: {url!r} is not an http(s) URL; give the "
                                 "server's OpenAI base, such as http://host:8000/v1")
        if self.autoscale_min_workers > self.autoscale_max_workers:
            raise ValueError(f"autoscale_min_workers ({self.autoscale_min_workers}) must not "
                             f"exceed autoscale_max_workers ({self.autoscale_max_workers})")
        return self

    @property
    def job_topics(self) -> dict[str, str]:
        """Priority name → Kafka topic name, for this process's model (served_model_name)."""
        return self.job_topics_for(self.served_model_name)

    def job_topics_for(self, model: str) -> dict[str, str]:
        """Priority name → Kafka topic name of a served model's jobs."""
        return job_topic_names(self.topic_prefix, model)

    @property
    def autoscale_weights(self) -> dict[str, float]:
        """Priority name → the weight of its lag in the autoscaler's sum."""
        return {"high": self.autoscale_weight_high, "normal": self.autoscale_weight_normal,
                "low": self.autoscale_weight_low}

    @property
    def consumer_group(self) -> str:
        """The consumer group of the inference workers of this process's model."""
        return self.consumer_group_for(self.served_model_name)

    def consumer_group_for(self, model: str) -> str:
        """The consumer group of a served model's inference workers."""
        return consumer_group_name(self.topic_prefix, model)


@lru_cache
def get_settings() -> Settings:
    """The process's settings, read once."""
    return Settings()
