"""`stream: true` on `/v1/chat/completions` and `/v1/completions`: the job's tokens as SSE.

The request is a job like any other (validated, queued at high priority, cached,
recorded); its body says `stream`, so the worker that runs it publishes its text step by
step (`workers.inference.token_publisher`), and this relays it (`api.token_relay`) as
OpenAI's chunks (`api.stream_chunks`). A cached answer finishes at once and goes out as
one chunk. A client that goes away cancels the job, as a non-streaming one does; a job
still unfinished after `sync_request_timeout_s` is cancelled and the stream ends with an
error event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.auth import CurrentTenant
from api.job_state import cancel_and_announce
from api.resources import LazyProducer, Resources
from api.schemas import JobPublic
from api.stream_chunks import (
    DONE,
    KEEPALIVE,
    ChunkMaker,
    error_event,
    result_calls,
    result_text,
    sse,
)
from api.submission import submit
from api.token_relay import Finished, Idle, TextDelta, follow_job
from api.tool_call_stream import ToolTextGate
from core.requests import ChatCompletionRequest, CompletionRequest, requested_priority
from core.topics import Priority
from storage.models import JobStatus

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def stream_completion(
    body: ChatCompletionRequest | CompletionRequest,
    tenant: CurrentTenant,
    resources: Resources,
    producer: LazyProducer,
    idempotency_key: str | None,
) -> StreamingResponse:
    """Queue the request as a job (high priority unless it asks otherwise, as a call
    without `stream` does) and answer with its chunks as they come."""
    submission = await submit(request=body, priority=requested_priority(
                                  body, default=Priority.HIGH), tenant=tenant,
                              idempotency_key=idempotency_key, resources=resources,
                              producer=producer)
    job = submission.job
    options = body.stream_options or {}
    chunks = ChunkMaker(kind=body.kind, job_id=job.id, model=body.model,
                        created=int(time.time()),
                        include_usage=options.get("include_usage") is True)
    gate = None
    if chunks.is_chat and body.tools:
        gate = ToolTextGate(body.tools, body.tool_choice)
    events = _events(resources, chunks, gate, job_id=job.id, tenant_id=tenant.id)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={**SSE_HEADERS, "X-Job-Id": job.id})


async def relay_job(resources: Resources, *, job_id: str, tenant_id: str,
                    opening: Iterable[bytes], text: Callable[[str], Iterable[bytes]],
                    ending: Callable[[JobPublic, float], list[bytes]]) -> AsyncIterator[bytes]:
    """An SSE body over the job's published text, in the caller's format (`opening`,
    `text` per delta, `ending` once the job is over); cancels the job when the body ends
    before the job did. Shared by the completion and the Responses streams."""
    is_over = False
    try:
        for part in opening:
            yield part
        limit_s = resources.settings.sync_request_timeout_s
        async for event in follow_job(resources, job_id=job_id, tenant_id=tenant_id,
                                      timeout_s=limit_s):
            if isinstance(event, TextDelta):
                for part in text(event.text):
                    yield part
            elif isinstance(event, Idle):
                yield KEEPALIVE
            elif isinstance(event, Finished):
                is_over = event.view.status.is_terminal
                for part in ending(event.view, limit_s):
                    yield part
                return
    finally:
        if not is_over:
            # The client went away (Starlette cancels this generator) or the time ran
            # out: the job is abandoned. Shielded, as the cancelled scope would cancel
            # the database call too.
            with anyio.CancelScope(shield=True):
                logger.info("stream of job %s ended before the job; cancelling it", job_id)
                await run_in_threadpool(cancel_abandoned, resources, job_id=job_id,
                                        tenant_id=tenant_id)


def _events(resources: Resources, chunks: ChunkMaker, gate: ToolTextGate | None, *,
            job_id: str, tenant_id: str) -> AsyncIterator[bytes]:
    """The SSE body of a streamed completion: OpenAI's chunks and [DONE]; with tools, the
    `gate` keeps calls out of the content (api.tool_call_stream)."""
    first = chunks.first(content=None if gate is not None and not gate.is_open else "")

    def text(delta: str) -> list[bytes]:
        if gate is not None:
            delta = gate.text(delta)
        return [sse(chunks.text(delta))] if delta else []

    return relay_job(resources, job_id=job_id, tenant_id=tenant_id,
                     opening=[] if first is None else [sse(first)], text=text,
                     ending=lambda view, limit_s: _ending(chunks, gate, view, limit_s))


def _ending(chunks: ChunkMaker, gate: ToolTextGate | None, view: JobPublic,
            limit_s: float) -> list[bytes]:
    """The events after the last text: the finish (and usage) chunks and [DONE], or the
    error event of a job that did not succeed."""
    if view.status is JobStatus.SUCCEEDED and view.result is not None:
        result: dict[str, Any] = view.result
        choices = result.get("choices") or [{}]
        parts = []
        if gate is not None:  # what the gate held of choice 0: its calls, or the rest
            rest, calls = gate.rest(choices[0].get("message") or {})
            if rest:
                parts.append(sse(chunks.text(rest)))
            if calls:
                parts.append(sse(chunks.calls(calls)))
        # Choice 0's logprobs come whole, after its text (api.stream_chunks).
        if choices[0].get("logprobs") is not None:
            parts.append(sse(chunks.logprobs(choices[0]["logprobs"])))
        # With n > 1 only choice 0's text was relayed (the others come whole with the
        # result): each other choice opens with its role and text, or its calls.
        for index in range(1, len(choices)):
            first = chunks.first(index)
            if first is not None:
                parts.append(sse(first))
            made = result_calls(result, index)
            logprobs = choices[index].get("logprobs")
            parts.append(sse(chunks.calls(made, index, logprobs) if made
                             else chunks.text(result_text(result, index), index, logprobs)))
        parts += [sse(chunks.finish(choice.get("finish_reason") or "stop", index))
                  for index, choice in enumerate(choices)]
        if chunks.include_usage and result.get("usage") is not None:
            parts.append(sse(chunks.usage(result["usage"])))
        parts.append(DONE)
        return parts
    return [error_event(stream_error(view, limit_s))]


def stream_error(view: JobPublic, limit_s: float) -> dict[str, Any]:
    """The error that ends the stream of a job that did not succeed: it was cancelled, it
    failed, or it is still unfinished when the stream's `limit_s` ran out."""
    if view.status is JobStatus.CANCELLED:
        return {"message": f"Job '{view.id}' was cancelled before it finished.",
                "type": "invalid_request_error", "code": "job_cancelled"}
    if not view.status.is_terminal:
        return {"message": f"The request did not finish within {limit_s:g} s and was "
                f"cancelled (job '{view.id}'); for long requests use POST /v1/jobs.",
                "type": "timeout", "code": "timeout"}
    return view.error or {"message": f"Job '{view.id}' failed."}


def cancel_abandoned(resources: Resources, *, job_id: str, tenant_id: str) -> None:
    """Cancel the job of a stream that ended before it did (run in a thread)."""
    with resources.sessions() as session:
        cancel_and_announce(session, resources.redis, prefix=resources.settings.topic_prefix,
                            job_id=job_id, tenant_id=tenant_id)
