"""Prometheus counters per tenant and model, with a bounded number of tenant labels.

A label per tenant is what an operator wants on a dashboard, and what can blow up a
Prometheus server when tenants number in the thousands. `TenantLabels` gives the first
`max_tenants` tenants a worker meets their own label (their id) and counts every later one
as `other`; the model label is bounded already (a worker serves the models it was
started with). Totals over all labels stay exact.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter

OTHER_TENANTS = "other"

TENANT_TOKENS = Counter(
    "batchinfer_tenant_tokens",
    "Tokens of finished jobs by tenant (id, or 'other' past the cap), model and kind "
    "(prompt, completion, cached: prompt tokens served from the prefix cache or, for an "
    "answer from the result cache, every prompt token).",
    ["tenant", "model", "kind"],
)
TENANT_JOBS = Counter(
    "batchinfer_tenant_jobs",
    "Finished jobs by tenant, model and outcome (succeeded, cached, failed).",
    ["tenant", "model", "outcome"],
)


class TenantLabels:
    """Maps tenant ids onto at most `max_tenants` distinct labels plus `other`."""

    def __init__(self, max_tenants: int) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be at least 1, not {max_tenants}")
        self.max_tenants = max_tenants
        self._labelled: set[str] = set()
        self._lock = threading.Lock()

    def of(self, tenant_id: str) -> str:
        """The tenant's label: its id while there is room, else `other`."""
        if tenant_id in self._labelled:
            return tenant_id
        with self._lock:
            if tenant_id in self._labelled or len(self._labelled) < self.max_tenants:
                self._labelled.add(tenant_id)
                return tenant_id
        return OTHER_TENANTS


def count_finished(labels: TenantLabels, *, tenant_id: str, model: str, outcome: str,
                   prompt_tokens: int = 0, completion_tokens: int = 0,
                   cached_tokens: int = 0) -> None:
    """Count one finished job and its tokens."""
    tenant = labels.of(tenant_id)
    TENANT_JOBS.labels(tenant, model, outcome).inc()
    for kind, tokens in (("prompt", prompt_tokens), ("completion", completion_tokens),
                         ("cached", cached_tokens)):
        if tokens:
            TENANT_TOKENS.labels(tenant, model, kind).inc(tokens)
