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

from api.deps import IdempotencyKeyDep, ProducerDep, ResourcesDep, TenantDep
from api.routes.completions import run_synchronously
from core.embedding_requests import EmbeddingRequest

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
    return await run_synchronously(body, request, tenant, resources, producer, idempotency_key)
