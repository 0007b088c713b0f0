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
import time
from collections.abc import AsyncIterator

import anyio
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.auth import CurrentTenant
from api.completion_stream import SSE_HEADERS, cancel_abandoned, stream_error
from api.resources import LazyProducer, Resources
from api.response_events import ResponseEvents
from api.schemas import ChatCompletionRequest, JobPublic
from api.stream_chunks import KEEPALIVE
from api.submission import submit
from api.token_relay import Finished, Idle, TextDelta, follow_job
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
    """Queue the Responses request (as its chat job, `stream` set) at high priority and
    answer with its events as they come."""
    submission = await submit(request=body, priority=Priority.HIGH, tenant=tenant,
                              idempotency_key=idempotency_key, resources=resources,
                              producer=producer)
    job_id = submission.job.id
    shell = response_shell(job_id=job_id, model=body.model, created_at=int(time.time()),
                           body=body.inference_body())
    events = _events(resources, ResponseEvents(job_id=job_id, shell=shell), job_id=job_id,
                     tenant_id=tenant.id)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={**SSE_HEADERS, "X-Job-Id": job_id})


async def _events(resources: Resources, events: ResponseEvents, *, job_id: str,
                  tenant_id: str) -> AsyncIterator[bytes]:
    """The SSE body; cancels the job when it ends before the job did (a client gone)."""
    is_over = False
    try:
        for part in events.opening():
            yield part
        limit_s = resources.settings.sync_request_timeout_s
        async for event in follow_job(resources, job_id=job_id, tenant_id=tenant_id,
                                      timeout_s=limit_s):
            if isinstance(event, TextDelta):
                for part in events.text(event.text):
                    yield part
            elif isinstance(event, Idle):
                yield KEEPALIVE
            elif isinstance(event, Finished):
                is_over = event.view.status.is_terminal
                for part in _ending(events, event.view, limit_s):
                    yield part
                return
    finally:
        if not is_over:
            # As in api.completion_stream: shielded, or the cancelled scope would cancel
            # the database call too.
            with anyio.CancelScope(shield=True):
                logger.info("stream of response job %s ended before the job; cancelling it",
                            job_id)
                await run_in_threadpool(cancel_abandoned, resources, job_id=job_id,
                                        tenant_id=tenant_id)


def _ending(events: ResponseEvents, view: JobPublic, limit_s: float) -> list[bytes]:
    """The last events: the finished response's, `response.failed` for a job that failed,
    an `error` event for one cancelled or out of time."""
    if view.status is JobStatus.SUCCEEDED and view.result is not None:
        return events.ending(view.result)
    error = stream_error(view, limit_s)
    if view.status is JobStatus.FAILED:
        return events.failed(error)
    return events.error(error)
