"""Prometheus metrics of the callbacks role: attempts, outcomes, attempt latency."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

WEBHOOK_ATTEMPTS = Counter(
    "batchinfer_webhook_attempts_total",
    "Webhook delivery attempts made, by event type.",
    ["event_type"],
)
WEBHOOK_DELIVERIES_SUCCEEDED = Counter(
    "batchinfer_webhook_deliveries_succeeded_total",
    "Webhook deliveries that got a 2xx, by event type.",
    ["event_type"],
)
WEBHOOK_DELIVERIES_FAILED = Counter(
    "batchinfer_webhook_deliveries_failed_total",
    "Webhook deliveries given up (permanent error or schedule exhausted), by event type.",
    ["event_type"],
)
WEBHOOK_ATTEMPT_SECONDS = Histogram(
    "batchinfer_webhook_attempt_seconds",
    "Latency of one webhook attempt, from resolving the host to the response's first bytes.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
