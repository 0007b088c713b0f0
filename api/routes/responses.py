"""OpenAI-compatible `/v1/responses`, in the subset the engine honours.

Text input (a string, or messages of text parts) with `instructions`, output length,
temperature, top_p and `text.format` (structured output), as batch lines already accept
it (`core.responses_api`). The request runs as a chat completion job of kind `response`
(queued at high priority, cached, recorded like any other) and is answered with the
`response` object the worker stored. With `background: true` it is not awaited: the
answer is the response as it stands (`queued`, OpenAI's way), its job id in `X-Job-Id`
and `Location` for GET /v1/jobs/{id} and its events. With `stream: true` the answer is
the Responses API's typed events as the text comes (`api.response_stream`).
`GET /v1/responses/{id}` reads one back: the stored `response` once its job succeeded,
before that (or when it failed or was cancelled) the response with the job's state as
its status; `POST .../cancel` cancels it (again: the cancelled response), and
`GET .../input_items` lists the input it ran on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from api.deps import (
    IdempotencyKeyDep,
    ProducerDep,
    RedisDep,
    ResourcesDep,
    SessionDep,
    TenantDep,
)
from api.errors import APIError, Conflict, InvalidRequest, NotFound
from api.job_state import cancel_and_announce
from api.response_stream import stream_response
from api.routes.completions import run_synchronously
from api.schemas import ChatCompletionRequest, job_path
from api.submission import submit
from core.request_checks import RequestRefused, describe_errors
from core.requests import requested_priority
from core.responses_api import (
    ECHOED_INSTRUCTIONS,
    input_items,
    response_shell,
    responses_names,
    to_chat_body,
)
from core.topics import Priority
from storage.jobs import get_job
from storage.models import Job, JobStatus

router = APIRouter(prefix="/v1", tags=["openai"])

# Responses fields that only steer this route; the rest go to `core.responses_api`.
_ROUTE_FIELDS = ("background", "stream", "stream_options")


class ResponseJobRequest(ChatCompletionRequest):
    """The chat completion a Responses body runs as; its job's result is a `response`."""

    # Run as the first system message; kept to be echoed back on the `response`.
    instructions: str | None = None
    # Queued with `background: true`, as the `response` says.
    background: bool | None = None

    def inference_body(self) -> dict[str, Any]:
        """The chat body, plus what the `response` echoes back: metadata, instructions,
        and whether it runs in the background."""
        body = super().inference_body()
        if self.metadata:
            body["metadata"] = dict(self.metadata)
        if self.instructions is not None:
            body["instructions"] = self.instructions
        if self.background:
            body["background"] = True
        return body

    @property
    def kind(self) -> Literal["response"]:  # type: ignore[override]
        """The OpenAI object the job's result will be."""
        return "response"


@router.post("/responses", response_model=None)
async def create_response(
    request: Request,
    tenant: TenantDep,
    resources: ResourcesDep,
    producer: ProducerDep,
    body: dict[str, Any] = Body(...),  # noqa: B008
    idempotency_key: IdempotencyKeyDep = None,
) -> Response:
    """Run a Responses request now and return its `response` (with `stream`, its events as
    they come), or with `background`, queue it and return the response queued."""
    stream = _route_flag(body, "stream")
    background = _route_flag(body, "background")
    _check_stream_options(body.get("stream_options"), stream=stream)
    if background and body.get("store") is False:
        raise InvalidRequest("background requires store: a response run in the background "
                             "is kept to be read back.", param="store",
                             code="invalid_value")
    if stream and background:
        raise InvalidRequest("background cannot be streamed; queue it with background and "
                             "follow it with GET /v1/jobs/{id}/events, or stream it without "
                             "background.", param="background", code="unsupported_parameter")
    with _named_as_responses():
        job_request = _as_job(body, stream=stream, background=background)
        if stream:
            return await stream_response(job_request, tenant, resources, producer,
                                         idempotency_key)
        if not background:
            return await run_synchronously(job_request, request, tenant, resources,
                                           producer, idempotency_key)
        submission = await submit(request=job_request, priority=requested_priority(
                                      job_request, default=Priority.NORMAL),
                                  tenant=tenant, idempotency_key=idempotency_key,
                                  resources=resources, producer=producer)
    headers = {"Location": job_path(submission.job.id), "X-Job-Id": submission.job.id}
    if submission.is_replay:
        headers["Idempotent-Replayed"] = "true"
    return JSONResponse(response_view(submission.job), headers=headers)


def _route_flag(body: dict[str, Any], name: str) -> bool:
    """A true/false field of this route (absent or null: false); 400 for anything else."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false.", param=name,
                             code="invalid_value")
    return value is True


def _check_stream_options(options: Any, *, stream: bool) -> None:
    """`stream_options` goes only with `stream`; its one field, `include_obfuscation`,
    is accepted and has no effect (no event is padded)."""
    if options is None:
        return
    if not stream:
        raise InvalidRequest("stream_options is only allowed with stream: true.",
                             param="stream_options", code="invalid_value")
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object.", param="stream_options",
                             code="invalid_value")
    for key, value in options.items():
        if key != "include_obfuscation":
            raise InvalidRequest(f"stream_options.{key} is not supported.",
                                 param=f"stream_options.{key}", code="unsupported_parameter")
        if not isinstance(value, bool):
            raise InvalidRequest("stream_options.include_obfuscation must be true or false.",
                                 param="stream_options.include_obfuscation",
                                 code="invalid_value")


@contextmanager
def _named_as_responses() -> Iterator[None]:
    """A refusal of the chat request a Responses body runs as, naming the fields the
    client sent (`max_output_tokens`, `text.format`, `input`), not chat's."""
    try:
        yield
    except APIError as e:
        if e.status_code < 500:
            e.message = responses_names(e.message)
            e.args = (e.message,)
            e.param = None if e.param is None else responses_names(e.param)
        raise


def _as_job(body: dict[str, Any], *, stream: bool, background: bool = False
            ) -> ResponseJobRequest:
    """The chat request of a Responses body; 400 naming the field it got wrong."""
    try:
        chat = to_chat_body({k: v for k, v in body.items() if k not in _ROUTE_FIELDS})
        if isinstance(body.get("instructions"), str):
            chat[ECHOED_INSTRUCTIONS] = body["instructions"]  # its system message runs it
        if stream:
            chat["stream"] = True  # the worker publishes its text as it comes
        if background:
            chat["background"] = True
        return ResponseJobRequest.model_validate(chat)
    except RequestRefused as e:
        raise InvalidRequest(e.message, param=e.param, code=e.code,
                             status_code=e.status_code) from e
    except ValidationError as e:
        param, message, code = describe_errors(e.errors(include_url=False))
        raise InvalidRequest(message, param=param, code=code) from e


# A job's state as the Responses API names a response's.
_RESPONSE_STATUS = {
    JobStatus.QUEUED: "queued", JobStatus.RUNNING: "in_progress",
    JobStatus.FAILED: "failed", JobStatus.CANCELLED: "cancelled", JobStatus.EXPIRED: "failed",
}
# Input items one page lists at most, and by default (OpenAI's bounds).
MAX_ITEMS_PAGE = 100
DEFAULT_ITEMS_PAGE = 20


def response_view(job: Job) -> dict[str, Any]:
    """Job `job`'s `response` as it stands: the stored object once it succeeded, before
    that the response with the job's state as its status (and its error once it failed).
    `created_at` is the job's creation on every read, as on the stream that opened it."""
    created_at = int(job.created_at.timestamp())
    if job.status is JobStatus.SUCCEEDED and job.result is not None:
        return {**job.result, "created_at": created_at}
    response = response_shell(job_id=job.id, model=job.model, created_at=created_at,
                              body=job.request)
    response["status"] = _RESPONSE_STATUS.get(job.status, "in_progress")
    if job.error and job.status is not JobStatus.CANCELLED:
        response["error"] = {"code": job.error.get("code") or "server_error",
                             "message": job.error.get("message") or "The request failed."}
    return response


def _response_job(session: SessionDep, tenant: TenantDep, response_id: str) -> Job:
    """The tenant's response job by id (`resp_<job id>`, or the job id); 404 otherwise."""
    job = get_job(session, job_id=response_id.removeprefix("resp_"), tenant_id=tenant.id)
    if job is None or job.kind != "response":
        raise NotFound(f"No response found with id '{response_id}'.", param="response_id",
                       code="response_not_found")
    return job


@router.get("/responses/{response_id}", response_model=None)
def read_response(response_id: str, tenant: TenantDep, session: SessionDep,
                  stream: bool = False, starting_after: int | None = None) -> dict[str, Any]:
    """A response by id (`resp_<job id>`), as OpenAI's retrieve returns it."""
    if stream or starting_after is not None:
        # Refused rather than answered as JSON, which a client asking for events reads as
        # a stream of none.
        raise InvalidRequest(
            "A stored response is not streamed again: read it whole, or follow its job's "
            "text with GET /v1/jobs/{id}/events (it resumes with Last-Event-ID).",
            param="stream" if stream else "starting_after", code="unsupported_parameter")
    return response_view(_response_job(session, tenant, response_id))


@router.post("/responses/{response_id}/cancel", response_model=None)
def cancel_response(response_id: str, tenant: TenantDep, session: SessionDep,
                    resources: ResourcesDep, redis_client: RedisDep) -> dict[str, Any]:
    """Cancel a queued or running response: the response, `cancelled` (again for one
    cancelled before); 409 for one that already finished otherwise."""
    job = _response_job(session, tenant, response_id)
    cancelled = cancel_and_announce(session, redis_client,
                                    prefix=resources.settings.topic_prefix, job_id=job.id,
                                    tenant_id=tenant.id)
    if cancelled is None:  # gone between the two reads
        raise NotFound(f"No response found with id '{response_id}'.", param="response_id",
                       code="response_not_found")
    if cancelled.status is not JobStatus.CANCELLED:
        view = response_view(cancelled)
        raise Conflict(f"Response '{response_id}' is already {view['status']}; it can no "
                       "longer be cancelled.", param="response_id",
                       code="response_not_cancellable")
    return response_view(cancelled)


@router.get("/responses/{response_id}/input_items", response_model=None)
def list_input_items(
    response_id: str,
    tenant: TenantDep,
    session: SessionDep,
    after: str | None = None,
    before: str | None = None,
    limit: int = Query(DEFAULT_ITEMS_PAGE, ge=1, le=MAX_ITEMS_PAGE),
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """The items of the response's `input`, a page at a time as OpenAI lists them: newest
    first unless `order=asc`, those after (or before) the item id given."""
    job = _response_job(session, tenant, response_id)
    items = input_items(job.request, job_id=job.id)
    if order == "desc":
        items.reverse()
    ids = [item["id"] for item in items]
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise InvalidRequest(f"{name} must be the id of one of this response's input "
                                 f"items; got '{cursor[:64]}'.", param=name,
                                 code="invalid_value")
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(items)
    between = items[start:end]
    # Paging forward from `after` (or the start), the first `limit`; back from `before`
    # alone, the `limit` just before it.
    page = between[-limit:] if before is not None and after is None else between[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(between) > len(page)}
