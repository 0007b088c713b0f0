"""OpenAI-compatible `POST /v1/responses`, in the subset the engine honours.

Text input (a string, or messages of text parts) with `instructions`, output length,
temperature, top_p and `text.format` (structured output), as batch lines already accept
it (`core.responses_api`). The request runs as a chat completion job of kind `response`
(queued at high priority, cached, recorded like any other) and is answered with the
`response` object the worker stored. With `background: true` it is not awaited: the
answer is the job (202), followed with GET /v1/jobs/{id}, whose result is the same object.
With `stream: true` the answer is the Responses API's typed events as the text comes
(`api.response_stream`). `GET /v1/responses/{id}` reads one back: the stored `response`
once its job succeeded, before that (or when it failed or was cancelled) the response
with the job's state as its status.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from fastapi import APIRouter, Body, Request
from fastapi.responses import Response
from pydantic import ValidationError

from api.deps import IdempotencyKeyDep, ProducerDep, ResourcesDep, SessionDep, TenantDep
from api.errors import APIError, InvalidRequest, NotFound
from api.response_stream import stream_response
from api.routes.completions import run_synchronously
from api.schemas import ChatCompletionRequest, JobPublic, job_path, model_response
from api.submission import submit
from core.request_checks import RequestRefused, describe_errors
from core.responses_api import (
    ECHOED_INSTRUCTIONS,
    response_shell,
    responses_names,
    to_chat_body,
)
from core.topics import Priority
from storage.jobs import get_job
from storage.models import JobStatus

router = APIRouter(prefix="/v1", tags=["openai"])

# Responses fields that only steer this route; the rest go to `core.responses_api`.
_ROUTE_FIELDS = ("background", "stream", "stream_options")


class ResponseJobRequest(ChatCompletionRequest):
    """The chat completion a Responses body runs as; its job's result is a `response`."""

    # Run as the first system message; kept to be echoed back on the `response`.
    instructions: str | None = None

    def inference_body(self) -> dict[str, Any]:
        """The chat body, plus the metadata and instructions the `response` echoes back."""
        body = super().inference_body()
        if self.metadata:
            body["metadata"] = dict(self.metadata)
        if self.instructions is not None:
            body["instructions"] = self.instructions
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
    they come), or with `background`, queue it and return its job."""
    stream = _route_flag(body, "stream")
    background = _route_flag(body, "background")
    _check_stream_options(body.get("stream_options"), stream=stream)
    if stream and background:
        raise InvalidRequest("background cannot be streamed; queue it with background and "
                             "follow it with GET /v1/jobs/{id}/events, or stream it without "
                             "background.", param="background", code="unsupported_parameter")
    with _named_as_responses():
        job_request = _as_job(body, stream=stream)
        if stream:
            return await stream_response(job_request, tenant, resources, producer,
                                         idempotency_key)
        if not background:
            return await run_synchronously(job_request, request, tenant, resources,
                                           producer, idempotency_key)
        submission = await submit(request=job_request, priority=Priority.NORMAL,
                                  tenant=tenant, idempotency_key=idempotency_key,
                                  resources=resources, producer=producer)
    headers = {"Location": job_path(submission.job.id), "X-Job-Id": submission.job.id}
    if submission.is_replay:
        headers["Idempotent-Replayed"] = "true"
    return model_response(JobPublic.from_job(submission.job),
                          status_code=200 if submission.is_replay else 202, headers=headers)


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


def _as_job(body: dict[str, Any], *, stream: bool) -> ResponseJobRequest:
    """The chat request of a Responses body; 400 naming the field it got wrong."""
    try:
        chat = to_chat_body({k: v for k, v in body.items() if k not in _ROUTE_FIELDS})
        if isinstance(body.get("instructions"), str):
            chat[ECHOED_INSTRUCTIONS] = body["instructions"]  # its system message runs it
        if stream:
            chat["stream"] = True  # the worker publishes its text as it comes
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


@router.get("/responses/{response_id}", response_model=None)
def read_response(response_id: str, tenant: TenantDep, session: SessionDep) -> dict[str, Any]:
    """A response by id (`resp_<job id>`), as OpenAI's retrieve returns it."""
    job_id = response_id.removeprefix("resp_")
    job = get_job(session, job_id=job_id, tenant_id=tenant.id)
    if job is None or job.kind != "response":
        raise NotFound(f"No response found with id '{response_id}'.", param="response_id",
                       code="response_not_found")
    if job.status is JobStatus.SUCCEEDED and job.result is not None:
        return dict(job.result)
    response = response_shell(job_id=job.id, model=job.model,
                              created_at=int(job.created_at.timestamp()), body=job.request)
    response["status"] = _RESPONSE_STATUS.get(job.status, "in_progress")
    if job.error:
        response["error"] = {"code": job.error.get("code") or "server_error",
                             "message": job.error.get("message") or "The request failed."}
    return response
