"""Per-tenant Prometheus counters: the tenant label is capped, totals stay exact."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from core.tenant_metrics import OTHER_TENANTS, TenantLabels, count_finished


def sample(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_tenants_past_the_cap_are_counted_as_other() -> None:
    labels = TenantLabels(max_tenants=2)
    assert [labels.of(t) for t in ("t1", "t2", "t3", "t1", "t4")] == [
        "t1", "t2", OTHER_TENANTS, "t1", OTHER_TENANTS]
    with pytest.raises(ValueError, match="at least 1"):
        TenantLabels(0)


def test_count_finished_adds_jobs_and_tokens_by_kind() -> None:
    labels = TenantLabels(max_tenants=1)
    model = "metrics-test-model"
    before = sample("batchinfer_tenant_tokens_total",
                    {"tenant": OTHER_TENANTS, "model": model, "kind": "prompt"})
    count_finished(labels, tenant_id="first", model=model, outcome="succeeded",
                   prompt_tokens=10, completion_tokens=5, cached_tokens=4)
    count_finished(labels, tenant_id="second", model=model, outcome="failed")
    count_finished(labels, tenant_id="third", model=model, outcome="cached", prompt_tokens=7,
                   cached_tokens=7)
    assert sample("batchinfer_tenant_tokens_total",
                  {"tenant": "first", "model": model, "kind": "completion"}) == 5
    assert sample("batchinfer_tenant_tokens_total",
                  {"tenant": "first", "model": model, "kind": "cached"}) == 4
    assert sample("batchinfer_tenant_tokens_total",
                  {"tenant": OTHER_TENANTS, "model": model, "kind": "prompt"}) == before + 7
    assert sample("batchinfer_tenant_jobs_total",
                  {"tenant": OTHER_TENANTS, "model": model, "outcome": "failed"}) == 1
