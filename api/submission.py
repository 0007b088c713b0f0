"""Accepting a job: validate, replay or admit, store, publish.

Responsible for the one path every submission takes (`POST /v1/jobs` and the
OpenAI-compatible completions alike):

    validate (shape, support, model, context) → Idempotency-Key replay? → rate limit,
    active-job cap → [grouped with concurrent submissions: broker connected? → insert
    `queued` → commit → produce to `<prefix>.jobs.<model>.<priority>` and wait for the acks]

Nothing is written for a rejected request: every check that can refuse runs before the
insert. The one failure after the insert is a send the broker does not acknowledge: the
row is deleted again before the 503 (see `api.job_writer`, which does the bracketed part
for every request that arrived within a few milliseconds, in one commit).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from kafka.errors import KafkaError
from starlette.concurrency import run_in_threadpool

from api.auth import CurrentTenant
from api.capabilities import can_check_without_io, check_request
from api.embedding_checks import check_embedding_request, check_generation_model
from api.errors import Conflict, InvalidParameter, RateLimited, ServiceUnavailable
from api.errors import ServiceStopping as StoppingError
from api.job_writer import WRITE_TIMEOUT_S
from api.resources import BrokerUnavailable, LazyProducer, Resources, ServiceStopping
from core.embedding_requests import EmbeddingRequest
from core.metrics import JOBS_SUBMITTED
from core.requests import AnyRequest
from core.topics import Priority
from core.webhook_urls import validate_callback_url
from storage.jobs import (
    IdempotencyKeyTaken,
    find_by_idempotency_key,
    new_job,
)
from storage.models import Job

logger = logging.getLogger(__name__)

# Retry-After for a tenant at its active-job cap: jobs take seconds, not milliseconds.
ACTIVE_JOBS_RETRY_AFTER_S = 5.0


@dataclass(frozen=True, slots=True)
class Submission:
    """The stored job, and whether it is an earlier request's job returned on replay."""

    job: Job
    is_replay: bool


def request_hash(request: AnyRequest | EmbeddingRequest) -> str:
    """SHA-256 of the request's canonical JSON (unset and null fields dropped)."""
    body = request.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    return json_hash({"endpoint": type(request).__name__, "body": body})


def json_hash(value: Any) -> str:
    """SHA-256 of `value`'s canonical JSON (sorted keys, no spaces): an Idempotency-Key's
    body fingerprint.

    Never raises on text: validation refuses lone surrogates in the fields it knows, but
    free-form ones (an accepted `response_format`'s other keys, a content part's extras)
    can still carry one, and 'surrogatepass' hashes it where plain UTF-8 would fail. Valid
    text encodes the same either way, so stored hashes keep matching.
    """
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


async def submit(
    *,
    request: AnyRequest | EmbeddingRequest,
    priority: Priority,
    tenant: CurrentTenant,
    idempotency_key: str | None,
    resources: Resources,
    producer: LazyProducer,
    deadline: datetime | None = None,
) -> Submission:
    """Store and publish one job, or return the job an identical earlier request made.

    Runs on the event loop; only what waits on I/O goes to the thread pool (a model's
    context not loaded yet, a long prompt, a callback host to resolve, an Idempotency-Key
    to look up, a tenant near its active-job cap). The rate limiter is an asyncio Redis
    call and the grouped writer answers through a future.
    """
    if request.model in resources.settings.served_models:
        await resources.model_states.refuse_if_failed(request.model)
    if (isinstance(request, EmbeddingRequest)
            or getattr(request, "callback_url", None) is not None
            or not can_check_without_io(request, resources)):
        await run_in_threadpool(check, request, resources)
    else:
        check(request, resources)
    # The hash only ever answers a replay of the same Idempotency-Key: none without one.
    digest = request_hash(request) if idempotency_key is not None else None
    if idempotency_key is not None:
        assert digest is not None
        earlier = await run_in_threadpool(_find_earlier, resources, tenant, idempotency_key)
        if earlier is not None:
            return _replay(earlier, digest, idempotency_key, resources, kind=request.kind)
    await _admit(tenant, resources)
    try:
        return await _queue(request, priority=priority, tenant=tenant,
                            idempotency_key=idempotency_key, digest=digest,
                            resources=resources, producer=producer, deadline=deadline)
    finally:
        resources.active_jobs.settle(tenant_id=tenant.id)


async def _queue(
    request: AnyRequest | EmbeddingRequest,
    *,
    priority: Priority,
    tenant: CurrentTenant,
    idempotency_key: str | None,
    digest: str | None,
    resources: Resources,
    producer: LazyProducer,
    deadline: datetime | None = None,
) -> Submission:
    """`submit` of an admitted request: its new job stored and published, or the replay
    of a concurrent request's with the same Idempotency-Key."""
    job = new_job(
        tenant_id=tenant.id,
        priority=priority,
        model=request.model,
        kind=request.kind,
        request=request.inference_body(),
        callback_url=getattr(request, "callback_url", None),
        metadata=request.metadata,
        idempotency_key=idempotency_key,
        request_hash=digest,
        cache_key=request.cache_key,
        published=True,
        deadline=deadline,
    )
    if resources.budgets is not None:
        await resources.budgets.reserve(job)  # 429 when a token budget is spent
    try:
        await _store_reserved(job, resources, producer)
    except IdempotencyKeyTaken:
        # A concurrent request with the same key committed first: answer as its replay.
        assert idempotency_key is not None and digest is not None
        earlier = await run_in_threadpool(_find_earlier, resources, tenant, idempotency_key)
        assert earlier is not None, "the key's unique index held, so its row exists"
        return _replay(earlier, digest, idempotency_key, resources, kind=request.kind)
    except ServiceStopping as e:
        raise StoppingError() from e
    except (BrokerUnavailable, KafkaError) as e:
        logger.warning("job not accepted, the broker did not take it: %s", e)
        raise ServiceUnavailable("message broker") from e
    JOBS_SUBMITTED.labels(priority=job.priority).inc()
    logger.debug("job %s queued (%s, %s)", job.id, job.priority, job.model)
    return Submission(job=job, is_replay=False)


async def _store_reserved(job: Job, resources: Resources, producer: LazyProducer) -> None:
    """`_store`, giving the job's token reservation back when it was not stored."""
    try:
        await _store(job, resources, producer)
    except Exception:
        if resources.budgets is not None:
            await resources.budgets.release(job)
        raise


async def _store(job: Job, resources: Resources, producer: LazyProducer) -> None:
    """Have the writer store and produce the job; raises what refused it.

    The done hub expects the job from before its row exists, so before any completion of
    it can be announced; its long-polls then skip their first read (`storage.job_done_hub`).
    """
    hub = resources.done_hub
    hub.expect(job.id, job.tenant_id)
    try:
        await asyncio.wait_for(asyncio.wrap_future(resources.writer.enqueue(job, producer)),
                               WRITE_TIMEOUT_S)
    except BaseException:
        hub.forget(job.id)  # not stored, or not known to be: its long-polls read first
        raise


def check(request: AnyRequest | EmbeddingRequest, resources: Resources) -> None:
    """Everything that can refuse the request before admission: 4xx naming the field."""
    settings = resources.settings
    if isinstance(request, EmbeddingRequest):
        check_embedding_request(request, resources)
    else:
        # The model's kind first: an embedding model's context says nothing of a chat body.
        check_generation_model(request.model, settings)
        check_request(request, resources)
    callback_url = getattr(request, "callback_url", None)
    if callback_url is not None:
        try:
            validate_callback_url(callback_url, settings)
        except ValueError as e:
            raise InvalidParameter(str(e), param="callback_url", code="invalid_callback_url") from e


def _find_earlier(resources: Resources, tenant: CurrentTenant, key: str) -> Job | None:
    with resources.sessions() as session:
        return find_by_idempotency_key(session, tenant_id=tenant.id, key=key)


def _replay(earlier: Job, digest: str, key: str, resources: Resources, *, kind: str
            ) -> Submission:
    if resources.writer.is_doubtful(earlier.id):
        # Its first request was answered 503 and its row is about to be withdrawn (within
        # a second of the database answering again): the retry must not adopt it.
        raise ServiceUnavailable(
            "database", "the earlier request with this Idempotency-Key is still being "
            "withdrawn after a failed commit")
    if earlier.kind != kind:
        raise Conflict(
            f"Idempotency-Key {key!r} was already used for a {earlier.kind} request "
            f"(job {earlier.id}), not a {kind} one; use a new key for a new request.",
            param="Idempotency-Key", code="idempotency_key_reused")
    if earlier.request_hash != digest:
        raise Conflict(
            f"Idempotency-Key {key!r} was already used with a different request body; "
            "use a new key for a new request.",
            param="Idempotency-Key", code="idempotency_key_reused")
    return Submission(job=earlier, is_replay=True)


async def _admit(tenant: CurrentTenant, resources: Resources) -> None:
    """429 when the tenant is over its submission rate or its active-job cap."""
    retry_after = await resources.limiter.retry_after_s(tenant.id)
    if retry_after is not None:
        raise RateLimited(
            f"Rate limit reached: at most {resources.limiter.rate_per_s:g} submissions per "
            "second per tenant.", retry_after_s=retry_after)
    gate, cap = resources.active_jobs, resources.settings.tenant_max_active_jobs
    if gate.admit_without_count(tenant_id=tenant.id):
        if gate.wants_recount(tenant_id=tenant.id):
            resources.active_counts.start(tenant.id, partial(_recount, resources, tenant))
        return
    # Every request in flight needs the count now: one count, shared.
    await resources.active_counts.run(tenant.id, partial(_count, resources, tenant))
    if not gate.admit_counted(tenant_id=tenant.id):
        raise RateLimited(
            f"Too many active jobs: at most {cap} may be queued or running at once; wait for "
            "some to finish.", retry_after_s=ACTIVE_JOBS_RETRY_AFTER_S,
            code="too_many_active_jobs")


async def _count(resources: Resources, tenant: CurrentTenant) -> None:
    await run_in_threadpool(_count_now, resources, tenant)


async def _recount(resources: Resources, tenant: CurrentTenant) -> None:
    """A refresh nobody waits for: a failure is the next needed count's to report."""
    try:
        await _count(resources, tenant)
    except Exception as e:
        logger.warning("recounting tenant %s's active jobs failed: %s", tenant.id, e)


def _count_now(resources: Resources, tenant: CurrentTenant) -> None:
    with resources.sessions() as session:
        resources.active_jobs.count(session, tenant_id=tenant.id)
