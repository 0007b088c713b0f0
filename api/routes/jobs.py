"""`/v1/jobs`: submit, read (with long-poll), list and cancel a tenant's jobs."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api.auth import CurrentTenant
from api.deadlines import check_attainable
from api.deps import (
    IdempotencyKeyDep,
    ProducerDep,
    RedisDep,
    ResourcesDep,
    SessionDep,
    TenantDep,
    WaitQuery,
    long_poll_s,
    resources_of,
)
from api.errors import Conflict, InvalidRequest, NotFound
from api.job_filters import MAX_UNIX_TIME, from_unix, list_filters
from api.job_state import cancel_and_announce, wait_for_job
from api.pagination import invalid_cursor
from api.resources import LazyProducer, Resources
from api.schemas import JobCreate, JobListPublic, JobPublic, job_path, model_response
from api.submission import submit
from core.deadlines import resolve_deadline
from core.embedding_requests import EmbeddingJobCreate
from core.requests import requested_priority
from core.topics import Priority
from storage.job_queries import JobFilter, list_jobs_where
from storage.jobs import MAX_LIST_LIMIT
from storage.models import JobStatus, utcnow

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def job_not_found(job_id: str) -> NotFound:
    """The 404 for a job that does not exist or belongs to another tenant."""
    return NotFound(f"No job found with id '{job_id}'.", param="job_id", code="job_not_found")


@router.post("", status_code=202, response_model=JobPublic)
async def create_job(
    raw: Annotated[dict[str, Any], Body()],
    request: Request,
    tenant: TenantDep,
    producer: ProducerDep,
    idempotency_key: IdempotencyKeyDep = None,
) -> Response:
    """Queue a job; 202 with its id and links (200 when an Idempotency-Key replays one).

    A body with `input` is an embeddings request; any other a chat or text completion.
    Ordinary requests are answered by `api.hot_path` with the same `accept_job`; this route
    documents the endpoint and takes the ones it hands over (see there).
    """
    return await accept_job(raw, tenant=tenant, idempotency_key=idempotency_key,
                            resources=resources_of(request), producer=producer)


async def accept_job(raw: dict[str, Any], *, tenant: CurrentTenant,
                     idempotency_key: str | None, resources: Resources,
                     producer: LazyProducer) -> Response:
    """`POST /v1/jobs`'s answer to a parsed body from an authenticated tenant.

    On the event loop: `api.submission.submit` hands to threads only what waits on I/O.
    The hottest route answers with its own Response (see `model_response`).
    """
    body = _job_request(raw)
    priority = requested_priority(body, default=Priority.NORMAL)
    deadline = None
    if isinstance(body, JobCreate) and body.deadline is not None:
        try:
            deadline = resolve_deadline(body.deadline, now=utcnow())
        except ValueError as e:
            raise InvalidRequest(str(e), param="deadline", code="invalid_value") from e
        # The estimate may read the load (once a second): off the event loop.
        await run_in_threadpool(
            check_attainable, resources.estimates, model=body.model,
            priority=priority.value, deadline=deadline,
            max_tokens=body.num_max_tokens, on_unattainable=body.on_unattainable)
    submission = await submit(request=body, priority=priority, tenant=tenant,
                              idempotency_key=idempotency_key, resources=resources,
                              producer=producer, deadline=deadline)
    headers = {"Location": job_path(submission.job.id)}
    if submission.is_replay:
        headers["Idempotent-Replayed"] = "true"
    return model_response(JobPublic.from_job(submission.job),
                          status_code=200 if submission.is_replay else 202, headers=headers)


def _job_request(raw: dict[str, Any]) -> JobCreate | EmbeddingJobCreate:
    """The body as the request it is; a 400 naming the field, exactly as FastAPI's own."""
    model: type[JobCreate] | type[EmbeddingJobCreate] = (
        EmbeddingJobCreate if "input" in raw else JobCreate)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        # One model, not a union, so each error's loc is the field's own path.
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in e.errors(include_url=False)]
        ) from e


@router.get("/{job_id}", response_model=JobPublic)
async def read_job(
    job_id: str,
    request: Request,
    tenant: TenantDep,
    wait: WaitQuery = 0,
) -> Response:
    """A job; with `wait`, held open until it finishes or `wait` seconds pass.

    Ordinary requests are answered by `api.hot_path` with the same `job_response`.
    """
    return await job_response(resources_of(request), job_id=job_id, tenant=tenant, wait=wait)


async def job_response(resources: Resources, *, job_id: str, tenant: CurrentTenant,
                       wait: float) -> Response:
    """`GET /v1/jobs/{job_id}`'s answer: the job's view, once done or after `wait` s."""
    view = await wait_for_job(resources, job_id=job_id, tenant_id=tenant.id,
                              timeout=long_poll_s(resources, wait))
    if view is None:
        raise job_not_found(job_id)
    return model_response(view)


@router.get("", response_model=JobListPublic)
def read_jobs(
    request: Request,
    tenant: TenantDep,
    session: SessionDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 20,
    after: Annotated[str | None, Query(
        description="The last id of the previous page (its `last_id`).")] = None,
    batch_id: Annotated[str | None, Query(description="Only this batch's jobs.")] = None,
    model: Annotated[str | None, Query(description="Only jobs for this model.")] = None,
    priority: Priority | None = None,
    created_after: Annotated[int | None, Query(
        ge=0, le=MAX_UNIX_TIME,
        description="Only jobs created at or after this Unix time.")] = None,
    created_before: Annotated[int | None, Query(
        ge=0, le=MAX_UNIX_TIME, description="Only jobs created before this Unix time.")] = None,
) -> JobListPublic:
    """The tenant's jobs, newest first, a page at a time, narrowed by every filter given
    (`metadata.<key>=<value>` matches a metadata key); `total` counts them all."""
    where = JobFilter(status=status, batch_id=batch_id, model=model,
                      priority=None if priority is None else priority.value,
                      metadata=list_filters(request), created_after=from_unix(created_after),
                      created_before=from_unix(created_before))
    try:
        jobs, has_more, total = list_jobs_where(session, tenant_id=tenant.id, where=where,
                                                limit=limit, after=after)
    except ValueError as e:
        raise invalid_cursor(e) from e
    data = [JobPublic.from_job(job) for job in jobs]
    return JobListPublic(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
        total=total,
    )


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel(
    job_id: str,
    tenant: TenantDep,
    session: SessionDep,
    resources: ResourcesDep,
    redis_client: RedisDep,
) -> JobPublic:
    """Cancel a queued or running job; 409 if it already finished otherwise."""
    job = cancel_and_announce(session, redis_client, prefix=resources.settings.topic_prefix,
                              job_id=job_id, tenant_id=tenant.id)
    if job is None:
        raise job_not_found(job_id)
    if job.status is not JobStatus.CANCELLED:
        raise Conflict(f"Job '{job_id}' already {job.status.value}; it can no longer be "
                       "cancelled.", param="job_id", code="job_not_cancellable")
    return JobPublic.from_job(job)
