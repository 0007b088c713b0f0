"""`stream: true` on `/v1/responses`: the job's text as the Responses API's typed events.

The same way as a streamed chat completion (`api.completion_stream`): the request is a
high-priority job whose body says `stream`, so its worker publishes the text step by step,
`api.token_relay` follows it, and this turns what it hears into `api.response_events`.
A cached answer finishes at once and goes out as one text delta. A client that goes away
cancels the job; a job unfinished after `sync_request_timeout_s` is cancelled and the
stream ends with an `error` event.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from api.auth import CurrentTenant
from api.completion_stream import SSE_HEADERS, relay_job, stream_error
from api.resources import LazyProducer, Resources
from api.response_events import ResponseEvents
from api.schemas import ChatCompletionRequest, JobPublic
from api.submission import submit
from core.requests import requested_priority
from core.responses_api import response_shell
from core.topics import Priority
from storage.models import JobStatus

logger = logging.getLogger(__name__)


async def stream_response(
    body: ChatCompletionRequest,
    tenant: CurrentTenant,
    resources: Resources,
    producer: LazyProducer,
    idempotency_key: str | None,
) -> StreamingResponse:
    """Queue the Responses request (as its chat job, `stream` set; high priority unless
    its `service_tier` says otherwise) and answer with its events as they come."""
    submission = await submit(request=body, priority=requested_priority(
                                  body, default=Priority.HIGH), tenant=tenant,
                              idempotency_key=idempotency_key, resources=resources,
                              producer=producer)
    job_id = submission.job.id
    shell = response_shell(job_id=job_id, model=body.model,
                           created_at=int(submission.job.created_at.timestamp()),
                           body=body.inference_body())
    events = _events(resources, ResponseEvents(job_id=job_id, shell=shell), job_id=job_id,
                     tenant_id=tenant.id)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={**SSE_HEADERS, "X-Job-Id": job_id})


def _events(resources: Resources, events: ResponseEvents, *, job_id: str,
            tenant_id: str) -> AsyncIterator[bytes]:
    """The SSE body: the Responses API's typed events."""
    return relay_job(resources, job_id=job_id, tenant_id=tenant_id, opening=events.opening(),
                     text=events.text,
                     ending=lambda view, limit_s: _ending(events, view, limit_s))


def _ending(events: ResponseEvents, view: JobPublic, limit_s: float) -> list[bytes]:
    """The last events: the finished response's, `response.failed` for a job that failed,
    an `error` event for one cancelled or out of time."""
    if view.status is JobStatus.SUCCEEDED and view.result is not None:
        return events.ending(view.result)
    error = stream_error(view, limit_s)
    if view.status is JobStatus.FAILED:
        return events.failed(error)
    return events.error(error)
