"""Exact and semantic result caches end to end: a worker, real Redis, PostgreSQL and broker.

Cached answers say so (`cached` in the result and the job), report no completion tokens
computed, never cross tenants, and `cache.mode: "off"` bypasses them. The semantic cache
here is the fallback path (no vector search in the test Redis), with all-MiniLM-L6-v2.
"""

from __future__ import annotations

from typing import Any

from storage.models import JobStatus
from storage.tenants import create_tenant
from tests.utils.worker_service import Service


def _greedy(prompt: str, **cache: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    if cache:
        body["cache"] = cache
    return body


def _run(svc: Service, bodies: list[dict[str, Any]]) -> list[Any]:
    job_ids = svc.submit("high", bodies)
    done = svc.wait_terminal(job_ids)
    jobs = [done[job_id] for job_id in job_ids]
    assert all(job.status == JobStatus.SUCCEEDED for job in jobs), [j.error for j in jobs]
    return jobs


def test_exact_hits_are_marked_free_and_bypassed_when_off(service) -> None:
    svc = service()
    svc.start_worker()
    (first,) = _run(svc, [_greedy("the cache test prompt")])
    assert first.result.get("cached") is None
    (again, off) = _run(svc, [_greedy("the cache test prompt"),
                              _greedy("the cache test prompt", mode="off")])
    assert again.result["cached"] == "exact"
    assert again.completion_tokens == 0
    assert again.result["usage"]["completion_tokens"] == 0
    assert again.result["choices"][0]["text"] == first.result["choices"][0]["text"]
    assert off.result.get("cached") is None
    assert off.completion_tokens == first.completion_tokens
    # Greedy output is the same whether a cache answered or the engine ran.
    assert off.result["choices"][0]["text"] == first.result["choices"][0]["text"]


def test_another_tenant_never_gets_a_cached_answer(service) -> None:
    svc = service()
    svc.start_worker()
    _run(svc, [_greedy("tenant isolation prompt")])
    with svc.sessions() as session:
        other = create_tenant(session, name="globex")
        session.commit()
    svc.tenant_id = other.id
    (theirs,) = _run(svc, [_greedy("tenant isolation prompt")])
    assert theirs.result.get("cached") is None


def test_semantic_hits_at_the_default_threshold_and_the_guard_refusing_blurred_ones(
    service,
) -> None:
    """Cosine similarities with all-MiniLM-L6-v2, measured: the paraphrase 0.968; "3" vs
    "4 spiders" 0.966 and "safe" vs "not safe" 0.993, both above the default 0.95, so
    only the guard keeps them from a wrong answer."""
    svc = service()
    svc.start_worker()
    asked = _run(svc, [_greedy("What is the capital of France?", mode="semantic"),
                       _greedy("How many legs do 3 spiders have?", mode="semantic"),
                       _greedy("Is it safe to eat raw eggs?", mode="semantic")])
    assert all(job.result.get("cached") is None for job in asked)
    paraphrase, four_spiders, negated, not_opted_in = _run(svc, [
        _greedy("What is the capital of France, exactly?", mode="semantic"),
        _greedy("How many legs do 4 spiders have?", mode="semantic"),
        _greedy("Is it not safe to eat raw eggs?", mode="semantic"),
        _greedy("What is the capital of France, exactly?"),
    ])
    cached = paraphrase.result["cached"]
    assert cached["kind"] == "semantic"
    assert cached["matched_job_id"] == asked[0].id
    assert 0.95 <= cached["similarity"] <= 1.0
    assert paraphrase.result["choices"][0]["text"] == asked[0].result["choices"][0]["text"]
    assert paraphrase.completion_tokens == 0
    assert four_spiders.result.get("cached") is None
    assert negated.result.get("cached") is None
    assert not_opted_in.result.get("cached") is None
