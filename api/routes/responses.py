"""OpenAI-compatible `POST /v1/responses`, in the subset the engine honours.

Text input (a string, or messages of text parts) with `instructions`, output length,
temperature, top_p and `text.format` (structured output), as batch lines already accept
it (`core.responses_api`). The request runs as a chat completion job of kind `response`
(queued at high priority, cached, recorded like any other) and is answered with the
`response` object the worker stored. With `background: true` it is not awaited: the
answer is the job (202), followed with GET /v1/jobs/{id}, whose result is the same object.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Body, Request
from fastapi.responses import Response
from pydantic import ValidationError

from api.deps import IdempotencyKeyDep, ProducerDep, ResourcesDep, TenantDep
from api.errors import InvalidRequest
from api.routes.completions import run_synchronously
from api.schemas import ChatCompletionRequest, JobPublic, job_path, model_response
from api.submission import submit
from core.request_checks import RequestRefused, describe_errors
from core.responses_api import to_chat_body
from core.topics import Priority

router = APIRouter(prefix="/v1", tags=["openai"])

# Responses fields that only steer this route; the rest go to `core.responses_api`.
_ROUTE_FIELDS = ("background", "stream")


class ResponseJobRequest(ChatCompletionRequest):
    """The chat completion a Responses body runs as; its job's result is a `response`."""

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
    """Run a Responses request now and return its `response`, or with `background`, queue
    it and return its job."""
    if body.get("stream"):
        raise InvalidRequest("stream is not supported on /v1/responses; stream a chat "
                             "completion instead (POST /v1/chat/completions).", param="stream",
                             code="unsupported_parameter")
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise InvalidRequest("background must be true or false.", param="background")
    job_request = _as_job(body)
    if not background:
        return await run_synchronously(job_request, request, tenant, resources, producer,
                                       idempotency_key)
    submission = await submit(request=job_request, priority=Priority.NORMAL, tenant=tenant,
                              idempotency_key=idempotency_key, resources=resources,
                              producer=producer)
    headers = {"Location": job_path(submission.job.id), "X-Job-Id": submission.job.id}
    if submission.is_replay:
        headers["Idempotent-Replayed"] = "true"
    return model_response(JobPublic.from_job(submission.job),
                          status_code=200 if submission.is_replay else 202, headers=headers)


def _as_job(body: dict[str, Any]) -> ResponseJobRequest:
    """The chat request of a Responses body; 400/422 naming the field it got wrong."""
    try:
        chat = to_chat_body({k: v for k, v in body.items() if k not in _ROUTE_FIELDS})
        return ResponseJobRequest.model_validate(chat)
    except RequestRefused as e:
        raise InvalidRequest(e.message, param=e.param, code=e.code,
                             status_code=e.status_code) from e
    except ValidationError as e:
        param, message, code = describe_errors(e.errors(include_url=False))
        raise InvalidRequest(message, param=param, code=code, status_code=422) from e
