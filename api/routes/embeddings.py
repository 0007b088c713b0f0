"""OpenAI-compatible `POST /v1/embeddings`.

Like the completions endpoints, a request becomes a high-priority job on its model's
topics, runs on one of that model's workers, and is awaited here; the answer is the
embeddings list object the worker stored. Bad input is refused before anything is
queued (see api.embedding_checks). For corpora, send the same body to `POST /v1/jobs`
or a batch with `endpoint: "/v1/embeddings"`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.deps import IdempotencyKeyDep, ProducerDep, ResourcesDep, TenantDep
from api.routes.completions import _await_finished, _job_error
from api.submission import submit
from core.embedding_requests import EmbeddingRequest
from core.topics import Priority
from storage.models import JobStatus

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/embeddings")
async def create_embeddings(
    body: EmbeddingRequest,
    request: Request,
    tenant: TenantDep,
    resources: ResourcesDep,
    producer: ProducerDep,
    idempotency_key: IdempotencyKeyDep = None,
) -> JSONResponse:
    """Embed `input` now (as a high-priority job) and return OpenAI's embeddings list."""
    submission = await run_in_threadpool(
        lambda: submit(request=body, priority=Priority.HIGH, tenant=tenant,
                       idempotency_key=idempotency_key, resources=resources, producer=producer)
    )
    job_id = submission.job.id
    view = await _await_finished(request, resources, job_id=job_id, tenant_id=tenant.id)
    if view.status is JobStatus.SUCCEEDED and view.result is not None:
        return JSONResponse(view.result, headers={"X-Job-Id": job_id})
    raise _job_error(view)
