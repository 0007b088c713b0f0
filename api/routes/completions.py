"""OpenAI-compatible `POST /v1/chat/completions` and `POST /v1/completions`.

Each request becomes a high-priority job, goes the same way as any other (database, Kafka,
a worker), and is awaited here; the answer is exactly the `chat.completion` or
`text_completion` object the worker stored, so OpenAI clients work unchanged. A request
whose client goes away, or that outlives `sync_request_timeout_s`, is cancelled. With
`stream: true` the answer is Server-Sent Events instead (`api.completion_stream`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from api.auth import CurrentTenant
from api.completion_stream import stream_completion
from api.deps import IdempotencyKeyDep, ProducerDep, ResourcesDep, TenantDep
from api.errors import APIError, Conflict, Timeout
from api.job_state import cancel_and_announce, wait_for_job
from api.resources import LazyProducer, Resources
from api.schemas import ChatCompletionRequest, CompletionRequest, JobPublic
from api.submission import submit
from core.embedding_requests import EmbeddingRequest
from core.requests import requested_priority
from core.topics import Priority
from storage.models import JobStatus

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["openai"])

# How often a waiting request checks whether its client is still connected, seconds.
DISCONNECT_CHECK_S = 5.0


@router.post("/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    tenant: TenantDep,
    resources: ResourcesDep,
    producer: ProducerDep,
    idempotency_key: IdempotencyKeyDep = None,
) -> Response:
    """Run a chat completion now (as a high-priority job) and return its `chat.completion`,
    or with `stream`, its `chat.completion.chunk`s as Server-Sent Events."""
    if body.stream:
        return await stream_completion(body, tenant, resources, producer, idempotency_key)
    return await run_synchronously(body, request, tenant, resources, producer, idempotency_key)


@router.post("/completions")
async def create_completion(
    body: CompletionRequest,
    request: Request,
    tenant: TenantDep,
    resources: ResourcesDep,
    producer: ProducerDep,
    idempotency_key: IdempotencyKeyDep = None,
) -> Response:
    """Run a text completion now (as a high-priority job) and return its `text_completion`,
    or with `stream`, its chunks as Server-Sent Events."""
    if body.stream:
        return await stream_completion(body, tenant, resources, producer, idempotency_key)
    return await run_synchronously(body, request, tenant, resources, producer, idempotency_key)


async def run_synchronously(
    body: ChatCompletionRequest | CompletionRequest | EmbeddingRequest,
    request: Request,
    tenant: CurrentTenant,
    resources: Resources,
    producer: LazyProducer,
    idempotency_key: str | None,
) -> JSONResponse:
    """Queue the request as a job (high priority, unless a vLLM-style `priority` says
    otherwise), await it, answer with its stored result
    (the OpenAI object) or its error."""
    priority = requested_priority(body, default=Priority.HIGH)
    submission = await submit(request=body, priority=priority, tenant=tenant,
                              idempotency_key=idempotency_key, resources=resources,
                              producer=producer)
    job_id = submission.job.id
    view = await _await_finished(request, resources, job_id=job_id, tenant_id=tenant.id)
    if view.status is JobStatus.SUCCEEDED and view.result is not None:
        return JSONResponse(view.result, headers={"X-Job-Id": job_id})
    raise _job_error(view)


async def _await_finished(
    request: Request, resources: Resources, *, job_id: str, tenant_id: str
) -> JobPublic:
    """The finished job; cancels it and raises on timeout or a client that went away."""
    limit_s = resources.settings.sync_request_timeout_s
    deadline = time.monotonic() + limit_s
    while True:
        # Wait in slices, so a client that hung up is noticed within DISCONNECT_CHECK_S.
        remaining = deadline - time.monotonic()
        view = await wait_for_job(resources, job_id=job_id, tenant_id=tenant_id,
                                  timeout=min(max(remaining, 0.0), DISCONNECT_CHECK_S))
        assert view is not None, "a published job is never deleted"
        if view.status.is_terminal:
            return view
        if time.monotonic() >= deadline:
            await run_in_threadpool(_cancel, resources, job_id=job_id, tenant_id=tenant_id)
            raise Timeout(f"The request did not finish within {limit_s:g} s and was "
                          f"cancelled (job '{job_id}'); for long requests use POST /v1/jobs.")
        if await request.is_disconnected():
            logger.info("client of job %s went away; cancelling it", job_id)
            await run_in_threadpool(_cancel, resources, job_id=job_id, tenant_id=tenant_id)
            raise Conflict(f"Client disconnected; job '{job_id}' was cancelled.",
                           code="client_disconnected")


def _cancel(resources: Resources, *, job_id: str, tenant_id: str) -> None:
    """Cancel an abandoned job so no worker spends time on it."""
    with resources.sessions() as session:
        cancel_and_announce(session, resources.redis, prefix=resources.settings.topic_prefix,
                            job_id=job_id, tenant_id=tenant_id)


def _job_error(view: JobPublic) -> APIError:
    """The HTTP error for a job that finished without a result."""
    if view.status is JobStatus.CANCELLED:
        return Conflict(f"Job '{view.id}' was cancelled before it finished.",
                        code="job_cancelled")
    error: dict[str, Any] = view.error or {}
    kind = error.get("type") or "server_error"
    # The worker's own errors are ours (500); a request it could not run is the client's.
    status = 400 if kind == "invalid_request_error" else 500
    failure = APIError(str(error.get("message") or f"Job '{view.id}' failed."),
                       param=error.get("param"), code=error.get("code"), status_code=status)
    failure.type = kind
    failure.headers = {"X-Job-Id": view.id}
    return failure
