"""Prometheus metrics shared by the service's roles.

The API counts submissions; workers count outcomes, latencies and engine state; the
autoscaler reports the lag it sees and the workers it asks for. Every metric lives in
prometheus_client's default registry, so `GET /metrics` on the API (which `batchinfer up`
runs in the autoscaler's process) and the worker's exporter (`worker_metrics_port`) serve
them with no extra wiring. Metric objects are created once, at import, as
prometheus_client requires: a second registration of the same name would raise.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Queue waits stretch from milliseconds (idle workers) to hours (a bulk batch behind a
# flood); end-to-end adds generation, which is seconds on a GPU and minutes on a CPU.
LATENCY_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0, 4 * 3600.0, 24 * 3600.0,
)  # fmt: skip

JOBS_SUBMITTED = Counter(
    "batchinfer_jobs_submitted", "Jobs accepted and queued, by priority.", ["priority"]
)
JOBS_COMPLETED = Counter(
    "batchinfer_jobs_completed", "Jobs that finished with a result, by priority.", ["priority"]
)
JOBS_FAILED = Counter(
    "batchinfer_jobs_failed", "Jobs that finished with an error, by priority.", ["priority"]
)
JOBS_CANCELLED = Counter(
    "batchinfer_jobs_cancelled", "Running jobs aborted on a cancel request.", ["priority"]
)
JOBS_EXPIRED = Counter(
    "batchinfer_jobs_expired", "Jobs still unfinished at their deadline, by priority.",
    ["priority"]
)
RESULT_CACHE_HITS = Counter(
    "batchinfer_result_cache_hits",
    "Jobs answered from the exact-result cache without the engine, by priority.",
    ["priority"],
)
QUEUE_WAIT_SECONDS = Histogram(
    "batchinfer_queue_wait_seconds",
    "From job creation until a worker started it, by priority.",
    ["priority"],
    buckets=LATENCY_BUCKETS_S,
)
END_TO_END_SECONDS = Histogram(
    "batchinfer_end_to_end_seconds",
    "From job creation until its result was stored, by priority.",
    ["priority"],
    buckets=LATENCY_BUCKETS_S,
)
ENGINE_TOKENS_PER_SECOND = Gauge(
    "batchinfer_engine_tokens_per_second", "Tokens the engine generates per second, recently."
)
KV_CACHE_USAGE = Gauge(
    "batchinfer_kv_cache_usage_ratio", "Fraction of the engine's KV cache blocks in use (0..1)."
)
ENGINE_RUNNING_SEQS = Gauge(
    "batchinfer_engine_running_seqs", "Sequences in the engine's running batch."
)
ENGINE_WAITING_SEQS = Gauge(
    "batchinfer_engine_waiting_seqs", "Sequences waiting for admission to the engine's batch."
)
PREFIX_CACHE_HIT_TOKENS = Counter(
    "batchinfer_prefix_cache_hit_tokens", "Prompt tokens served from the engine's prefix cache."
)
ENGINE_PREEMPTIONS = Counter(
    "batchinfer_engine_preemptions", "Sequences preempted (to be recomputed) by the engine."
)
WORKER_INFLIGHT = Gauge(
    "batchinfer_worker_inflight_jobs", "Jobs a worker has taken from Kafka and not yet finished."
)
CACHE_LOOKUPS = Counter(
    "batchinfer_cache_lookups",
    "Cache lookups by the workers, by cache kind (exact, semantic) and outcome (hit, miss).",
    ["kind", "outcome"],
)
CACHE_BYTES = Counter(
    "batchinfer_cache_bytes",
    "Bytes of exact and semantic cache entries a worker wrote (stored) or answered jobs "
    "from (loaded), by kind and direction.",
    ["kind", "direction"],
)
CACHE_EVICTIONS = Counter(
    "batchinfer_cache_evictions",
    "Exact and semantic cache entries that left other than by being overwritten (a scope's "
    "cap, expiry), each counted once by the worker whose call removed it, by kind.",
    ["kind"],
)
CACHE_RESIDENT_BYTES = Gauge(
    "batchinfer_cache_resident_bytes",
    "Value bytes the exact and semantic caches hold (all workers together), by kind.",
    ["kind"],
)
CACHE_ERRORS = Counter(
    "batchinfer_cache_errors",
    "Redis errors of the exact and semantic caches (read as misses or skipped writes), by kind.",
    ["kind"],
)
KV_TIER_BLOCKS = Counter(
    "batchinfer_kv_tier_blocks",
    "Prefix KV blocks a worker asked the Redis KV tier for, by outcome (hit, miss), and "
    "blocks it dropped instead of storing while its writer was behind (dropped).",
    ["outcome"],
)
KV_TIER_BYTES = Counter(
    "batchinfer_kv_tier_bytes",
    "Bytes of KV blocks a worker moved to or from the Redis KV tier, by direction "
    "(stored, loaded).",
    ["direction"],
)
KV_TIER_EVICTIONS = Counter(
    "batchinfer_kv_tier_evictions",
    "KV blocks a worker's stores pushed out of the Redis KV tier's byte budget.",
)
KV_TIER_ERRORS = Counter(
    "batchinfer_kv_tier_errors",
    "Redis errors of the KV tier (each bypasses the tier for a few seconds).",
)
KV_TIER_RESIDENT_BYTES = Gauge(
    "batchinfer_kv_tier_resident_bytes",
    "Bytes the Redis KV tier holds for the worker's model revision (all workers together).",
)
WORKER_FETCH_STALLS = Counter(
    "batchinfer_worker_fetch_stalls",
    "Partitions a worker found silent with records waiting, and restarted from their "
    "committed offset.",
    ["topic"],
)
WORKER_DATABASE_ERRORS = Counter(
    "batchinfer_worker_database_errors",
    "Claims and result writes a worker could not make because the database was "
    "unreachable (each tried again after a back-off).",
)
ESTIMATED_DRAIN_SECONDS = Gauge(
    "batchinfer_estimated_drain_seconds",
    "Seconds the model's live workers need, at their measured pace, for all its queued and "
    "running work (the horizon of the ETAs jobs and batches show), by served model.",
    ["model"],
)
SERVICE_TOKENS_PER_SECOND = Gauge(
    "batchinfer_service_tokens_per_second",
    "Tokens per busy second the model's live workers measured (summed), by served model.",
    ["model"],
)
DEADLINE_WORKERS = Gauge(
    "batchinfer_deadline_workers",
    "Workers the queued deadlines need at the measured pace per worker, by served model.",
    ["model"],
)
AUTOSCALER_DESIRED_WORKERS = Gauge(
    "batchinfer_autoscaler_desired_workers",
    "Inference workers the autoscaler asks for (after clamping and the scale-down cooldown), "
    "by served model.",
    ["model"],
)
AUTOSCALER_WEIGHTED_LAG = Gauge(
    "batchinfer_autoscaler_weighted_lag",
    "The workers' consumer lag times its priority's weight, by served model and priority.",
    ["model", "priority"],
)
AUTOSCALER_LAG_READ_ERRORS = Counter(
    "batchinfer_autoscaler_lag_read_errors",
    "Lag reads that failed (the worker count was kept as it was).",
)
EMBEDDED_SERVICE_RESTARTS = Counter(
    "batchinfer_embedded_service_restarts",
    "Embedded services (broker, Redis) that `batchinfer up` restarted after they died.",
    ["service"],
)
JOBS_RECLAIMED = Counter(
    "batchinfer_jobs_reclaimed",
    "Running jobs whose worker died or left, by outcome: requeued (re-published) or "
    "failed (its last attempt).",
    ["outcome"],
)
JOBS_UNPUBLISHABLE = Counter(
    "batchinfer_jobs_unpublishable",
    "Jobs the reconciler failed because no Kafka message could be built or sent for them.",
)
ENGINE_SERVER_RETRIES = Counter(
    "batchinfer_engine_server_retries",
    "Requests to an engine server tried again (429/503, a dropped connection), by reason.",
    ["reason"],
)
