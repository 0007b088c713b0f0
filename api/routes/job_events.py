"""`GET /v1/jobs/{job_id}/events`: follow a job as Server-Sent Events.

Events, each `event: <name>` with a JSON `data:` line:
- `queued` (the job's view) when it has not started yet;
- `started` (`{"id": ...}`) once an engine runs it;
- `token` (`{"text": ...}`) as its text grows: joined, they are the result's text;
- `finished` (the job's view, with its result or error), last.
A job that already ended answers `finished` at once. Leaving does not cancel the job (it
was queued to run on its own; `POST /v1/jobs/{id}/cancel` does that).

Every event carries an `id:`: how many characters of the job's text the events up to it
hold. A client that reconnects with `Last-Event-ID` (as an `EventSource` does by itself)
gets the events after that point: `started` again if the job runs, then only the text it
has not seen, so joining its tokens across connections still gives the result's text.

A job submitted without `stream` is streamed by its worker only while someone follows it:
this asks the workers to (`storage.token_streams.publish_follow`) and asks again every
FOLLOW_REFRESH_S until it starts, as a worker keeps such an ask only for a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import StreamingResponse

from api.deps import TenantDep, resources_of
from api.errors import InvalidParameter
from api.job_state import wait_for_job
from api.resources import Resources
from api.routes.jobs import job_not_found
from api.schemas import JobPublic
from api.stream_chunks import KEEPALIVE, named_sse, result_calls, result_text
from api.token_relay import Finished, Idle, Started, TextDelta, follow_job
from storage.models import JobStatus
from storage.token_streams import publish_follow

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

# How often a follower of a job that has not started asks the workers again.
FOLLOW_REFRESH_S = 3.0
# How long one events stream may last (a client reconnects for more).
MAX_FOLLOW_S = 24 * 3600.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.get("/{job_id}/events")
async def job_events(job_id: str, request: Request, tenant: TenantDep,
                     last_event_id: Annotated[str | None, Header()] = None
                     ) -> StreamingResponse:
    """The job's events as SSE: queued, started, token deltas, finished with the result;
    after `Last-Event-ID` when a client resumes."""
    seen = _characters_seen(last_event_id)
    resources = resources_of(request)
    view = await wait_for_job(resources, job_id=job_id, tenant_id=tenant.id, timeout=0)
    if view is None:
        raise job_not_found(job_id)
    if view.status.is_terminal and seen > (length := _text_length(view)):
        raise InvalidParameter(
            f"Last-Event-ID {seen} is past the end of the job's text ({length} "
            "characters): this endpoint never sent it.", param="Last-Event-ID")
    return StreamingResponse(_events(resources, view, tenant_id=tenant.id, seen=seen),
                             media_type="text/event-stream", headers=SSE_HEADERS)


def _characters_seen(last_event_id: str | None) -> int:
    """The text a resuming client holds, from its `Last-Event-ID` (0 when it sends none)."""
    if last_event_id is None or not last_event_id.strip():
        return 0
    value = last_event_id.strip()
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise InvalidParameter(
            f"Last-Event-ID must be an id this endpoint sent (a count of characters), "
            f"got {value[:40]!r}", param="Last-Event-ID")
    return int(value)


async def _events(resources: Resources, view: JobPublic, *, tenant_id: str, seen: int = 0
                  ) -> AsyncIterator[bytes]:
    if view.status.is_terminal:
        yield named_sse("finished", view.model_dump(mode="json"), _text_length(view))
        return
    # `seen` may run past what the job will write (it is not known yet); the `finished`
    # event's id is the text's length all the same.
    asking = asyncio.ensure_future(_keep_asking(resources, view.id))
    sent = 0  # characters of text relayed on this connection, the skipped ones included
    try:
        is_started = view.status is JobStatus.RUNNING
        yield named_sse("started", {"id": view.id}, seen) if is_started else named_sse(
            "queued", view.model_dump(mode="json"), seen)
        async for event in follow_job(resources, job_id=view.id, tenant_id=tenant_id,
                                      timeout_s=MAX_FOLLOW_S):
            if isinstance(event, Started | TextDelta):
                asking.cancel()  # a worker streams it
                if not is_started:
                    is_started = True
                    yield named_sse("started", {"id": view.id}, max(seen, sent))
            if isinstance(event, TextDelta):
                start, sent = sent, sent + len(event.text)
                if sent > seen:  # what the client already holds is left out
                    yield named_sse("token", {"text": event.text[max(0, seen - start):]}, sent)
            elif isinstance(event, Idle):
                yield KEEPALIVE
            elif isinstance(event, Finished):
                yield named_sse("finished", event.view.model_dump(mode="json"),
                                _text_length(event.view))
                return
    finally:
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking


def _text_length(view: JobPublic) -> int:
    """Characters of the text a finished job's token events would have held."""
    if view.result is None or result_calls(view.result):
        return 0
    return len(result_text(view.result))


async def _keep_asking(resources: Resources, job_id: str) -> None:
    """Ask workers to stream the job now and every FOLLOW_REFRESH_S (until cancelled)."""
    while True:
        await publish_follow(resources.aredis, prefix=resources.settings.topic_prefix,
                             job_id=job_id)
        await asyncio.sleep(FOLLOW_REFRESH_S)
