"""Token budgets on the real Redis, PostgreSQL, broker and roles: reserve, refuse, settle.

What is checked: concurrent reservations never overshoot a budget (the Lua script is the
only writer); a synchronous submission over budget is a 429 naming the budget, with
Retry-After, and writes nothing; a batch over budget is not failed: the lines that do not
fit wait in its file, and run once the budget allows; the worker settles each job's
reservation with what it used, so the counter equals the stored usage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa

from core.kafka import ensure_topics
from core.settings import Settings
from storage.db import create_db_engine, session_factory
from storage.migrate import upgrade
from storage.models import Job
from storage.tenant_limits import ALL_MODELS, Budget, set_limits
from storage.token_budget import TokenBudgets
from tests.utils.api import count_jobs, make_tenant_key
from tests.utils.batch_service import CHAT, TERMINAL, BatchService, chat_line, jsonl
from tests.utils.service import running_api

MODEL = "smollm2-135m-instruct"


def test_concurrent_reservations_never_overshoot_and_settling_moves_the_count(
        redis_client: redis.Redis, topic_prefix: str) -> None:
    """40 threads reserving 30 tokens each against 1,000/day admit exactly 33; settling a
    job at 10 frees 20, a job without a reservation changes nothing."""
    budgets = TokenBudgets(redis_client, prefix=topic_prefix)
    day = Budget(ALL_MODELS, 86_400, 1000)

    def reserve(i: int) -> int:
        return budgets.reserve(tenant_id="ten_a", budgets=[day],
                               jobs=[(f"job-{i}", 30)]).num_granted

    with ThreadPoolExecutor(8) as pool:
        granted = list(pool.map(reserve, range(40)))
    assert sum(granted) == 33
    assert budgets.used(tenant_id="ten_a", budget=day, at=time.time()) == 990
    refused = budgets.reserve(tenant_id="ten_a", budgets=[day], jobs=[("late", 30)])
    assert refused.num_granted == 0 and refused.blocking == day
    assert 0 < refused.retry_after_s <= 86_400
    first = granted.index(1)
    assert budgets.settle([(f"job-{first}", 10), ("never-reserved", 500)]) == 1
    assert budgets.used(tenant_id="ten_a", budget=day, at=time.time()) == 970
    assert budgets.settle([(f"job-{first}", 10)]) == 0  # settled once only
    # Another tenant's counter is its own.
    assert budgets.reserve(tenant_id="ten_b", budgets=[day], jobs=[("b", 999)]).num_granted == 1


def test_a_job_larger_than_the_budget_runs_alone(redis_client: redis.Redis,
                                                 topic_prefix: str) -> None:
    """Above what a budget holds: a full bucket (or an empty day) admits it, and the
    bucket's debt then holds the next job back until it has refilled."""
    budgets = TokenBudgets(redis_client, prefix=topic_prefix)
    minute, day = Budget(ALL_MODELS, 60, 100), Budget(ALL_MODELS, 86_400, 100)
    verdict = budgets.reserve(tenant_id="t", budgets=[minute], jobs=[("big", 500), ("x", 1)])
    assert verdict.num_granted == 1 and verdict.blocking == minute
    # 500 - 1.67 tokens of debt at 100/60 tokens a second: about five minutes.
    assert 290 < verdict.retry_after_s < 300
    verdict = budgets.reserve(tenant_id="u", budgets=[day], jobs=[("big", 500), ("x", 1)])
    assert verdict.num_granted == 1 and verdict.blocking == day


@pytest.fixture
def api(settings: Any) -> Iterator[tuple[Settings, str, Any]]:
    """The API on uvicorn over migrated PostgreSQL, with topics; no worker."""
    s: Settings = settings(topic_partitions=1, served_models=[MODEL],
                           tenant_limits_refresh_s=0.01)
    upgrade(s.database_url)
    ensure_topics(s)
    engine = create_db_engine(s.database_url)
    try:
        with running_api(s) as url:
            yield s, url, session_factory(engine)
    finally:
        engine.dispose()


def test_a_submission_over_budget_is_429_naming_the_budget(
        api: tuple[Settings, str, Any]) -> None:
    """Budget of 60 tokens/minute (one a second, a bucket of one), jobs of ~26 (16
    characters ≈ 4, max_tokens 22): the first is queued from the full bucket, the second is
    429 with Retry-After (the 26 s the debt takes to refill) and the budget named, and is
    not written; another tenant is not held back."""
    settings, url, sessions = api
    acme = make_tenant_key(sessions, "acme")
    other = make_tenant_key(sessions, "other")
    with sessions() as session:
        set_limits(session, tenant_id=acme.tenant_id, tokens_per_minute=60)
        session.commit()
    body = {"model": MODEL, "max_tokens": 22, "prompt": "0123456789abcdef"}
    with httpx.Client(base_url=url, headers=acme.headers, timeout=30) as client:
        first = client.post("/v1/jobs", json=body)
        refused = client.post("/v1/jobs", json=body)
    assert first.status_code == 202, first.text
    assert refused.status_code == 429, refused.text
    assert 20 <= int(refused.headers["Retry-After"]) <= 27
    error = refused.json()["error"]
    assert error["code"] == "token_budget_exceeded" and error["param"] == "tokens_per_minute"
    assert error["type"] == "rate_limit_error"
    assert "tokens_per_minute is 60 tokens" in error["message"]
    assert count_jobs(sessions) == 1
    with httpx.Client(base_url=url, headers=other.headers, timeout=30) as client:
        assert client.post("/v1/jobs", json=body).status_code == 202  # its own budget: none


def test_a_batch_over_budget_waits_and_its_usage_settles_exactly(
        batch_services: Callable[..., BatchService]) -> None:
    """12 lines of ~5 estimated tokens against 25 tokens/day: 5 run, the rest wait (the
    batch stays in progress, nothing fails); the day's counter then equals the stored
    jobs' prompt + completion tokens; lifting the budget lets the batch complete."""
    svc = batch_services()
    with svc.sessions() as session:
        set_limits(session, tenant_id=svc.tenant_id, tokens_per_day=25)
        session.commit()
    client = svc.openai()
    lines = [chat_line(f"req-{i}", svc.settings.model, content=f"Question {i:02d}")
             for i in range(12)]
    uploaded = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                  completion_window="24h")
    done = svc.wait_batch(client, batch.id, lambda b: b.request_counts is not None
                          and b.request_counts.completed == 5)
    deadline = time.monotonic() + 60
    while "wait for the tenant's token budget" not in svc.scheduler.log_tail():
        assert time.monotonic() < deadline, svc.logs()
        time.sleep(0.1)
    assert done.status == "in_progress"
    with svc.sessions() as session:
        rows = session.execute(sa.select(Job.prompt_tokens, Job.completion_tokens)
                               .where(Job.batch_id == batch.id)).all()
    assert len(rows) == 5
    counters = redis.Redis.from_url(svc.settings.redis_url)
    budgets = TokenBudgets(counters, prefix=svc.settings.topic_prefix)
    used = budgets.used(tenant_id=svc.tenant_id, budget=Budget(ALL_MODELS, 86_400, 25),
                        at=time.time())
    assert used == sum((p or 0) + (c or 0) for p, c in rows)
    with svc.sessions() as session:
        set_limits(session, tenant_id=svc.tenant_id, tokens_per_day=0)
        session.commit()
    done = svc.wait_batch(client, batch.id, lambda b: b.status in TERMINAL)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
    # Usage: the batch's and the tenant's totals are the stored jobs' sums, exactly.
    with svc.sessions() as session:
        sums = session.execute(
            sa.select(sa.func.sum(Job.prompt_tokens), sa.func.sum(Job.completion_tokens),
                      sa.func.sum(Job.cached_tokens))
            .where(Job.tenant_id == svc.tenant_id, Job.finished_at.is_not(None))).one()
    prompt, completion, cached = (int(v or 0) for v in sums)
    assert done.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (prompt, completion)
    with httpx.Client(base_url=svc.url, timeout=30,
                      headers={"Authorization": f"Bearer {svc.api_key}"}) as http:
        usage = http.get("/v1/usage", params={"group_by": "model,day"}).json()
    totals = usage["totals"]
    assert (totals["num_jobs"], totals["prompt_tokens"], totals["completion_tokens"],
            totals["cached_tokens"]) == (12, prompt, completion, cached)
    assert sum(b["total_tokens"] for b in usage["data"]) == prompt + completion
