"""Bodies of the public API: requests (defined in `core.requests`) and views.

Responsible for: the public views of jobs and models, the file expiry policy, and giving
the API's routes the request models. The request models live in `core.requests` because
the scheduler validates batch lines with the very same ones; pydantic turns violations
into a 400 naming the field. What parses but is not supported, or does not fit the
model's context, is refused by `core.request_checks` (400).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi import Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Row

from core.requests import AnyRequest as AnyRequest
from core.requests import CallbackUrl as CallbackUrl
from core.requests import ChatCompletionRequest as ChatCompletionRequest
from core.requests import ChatMessage as ChatMessage
from core.requests import CompletionRequest as CompletionRequest
from core.requests import ContentPart as ContentPart
from core.requests import JobCreate as JobCreate
from core.requests import Metadata as Metadata
from core.requests import SamplingRequest as SamplingRequest
from core.topics import Priority
from storage.files import MAX_EXPIRES_AFTER_S, MIN_EXPIRES_AFTER_S
from storage.models import Job, JobStatus, unix_seconds

if TYPE_CHECKING:
    from storage.queue_estimates import Estimate


class ExpiresAfter(BaseModel):
    """OpenAI's expiry policy for a file: `seconds` after `anchor` (only `created_at`)."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRES_AFTER_S, le=MAX_EXPIRES_AFTER_S)


class Usage(BaseModel):
    """Token counts of a finished job, in OpenAI's names."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class JobLinks(BaseModel):
    """Where to read and cancel a job."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    self_: str = Field(alias="self")
    cancel: str


def unix_or_none(at: float | None) -> int | None:
    """Seconds since the epoch, rounded, or None."""
    return None if at is None else round(at)


class JobPublic(BaseModel):
    """A job as clients see it; `result` is the stored OpenAI response object."""

    id: str
    object: Literal["job"] = "job"
    status: JobStatus
    priority: Priority
    model: str
    created_at: int
    started_at: int | None
    finished_at: int | None
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    usage: Usage | None
    metadata: dict[str, str] | None
    # How a cache answered it: "exact", or {"kind": "semantic", "similarity",
    # "matched_job_id"}; None when the engine ran it.
    cached: str | dict[str, Any] | None = None
    # Unix time it must be done by, if it has a deadline.
    deadline: int | None = None
    # While queued or running (see api.estimates): queued jobs of its model taken before
    # it (0 once running), and when it should start and finish (unix time; None while the
    # model has no measured worker).
    queue_position: int | None = None
    estimated_start_at: int | None = None
    estimated_completion_at: int | None = None
    links: JobLinks

    def with_estimate(self, estimate: Estimate | None) -> JobPublic:
        """This view with a queue position and ETAs (unchanged when there are none)."""
        if estimate is None:
            return self
        self.queue_position = estimate.queue_position
        self.estimated_start_at = unix_or_none(estimate.estimated_start_at)
        self.estimated_completion_at = unix_or_none(estimate.estimated_completion_at)
        return self

    @classmethod
    def from_job(cls, job: Job | Row[*tuple[Any, ...]]) -> JobPublic:
        """The public view of a job: its row, or `storage.jobs.job_view`'s columns of it."""
        usage = None
        if job.prompt_tokens is not None and job.completion_tokens is not None:
            usage = Usage(
                prompt_tokens=job.prompt_tokens,
                completion_tokens=job.completion_tokens,
                total_tokens=job.prompt_tokens + job.completion_tokens,
                prompt_tokens_details=(
                    {"cached_tokens": job.cached_tokens} if job.cached_tokens is not None
                    else None
                ),
            )
        path = job_path(job.id)
        return cls(
            id=job.id,
            status=job.status,
            priority=Priority(job.priority),
            model=job.model,
            created_at=int(job.created_at.timestamp()),
            started_at=unix_seconds(job.started_at),
            finished_at=unix_seconds(job.finished_at),
            result=job.result,
            error=job.error,
            usage=usage,
            metadata=job.metadata_,
            cached=(job.result or {}).get("cached"),
            deadline=unix_seconds(getattr(job, "deadline", None)),
            links=JobLinks.model_validate({"self": path, "cancel": f"{path}/cancel"}),
        )


def model_response(view: BaseModel, *, status_code: int = 200,
                   headers: dict[str, str] | None = None) -> Response:
    """A view as the JSON FastAPI would send for it, built directly.

    A route returning a model has FastAPI validate it against `response_model` again and
    then dump it; a Response is sent as is. On the routes every job passes (submit,
    long-poll) that is ~25 us of each request's ~600 on the event loop. The routes keep
    `response_model`, so the OpenAPI schema still documents the view.
    """
    return Response(view.model_dump_json(), status_code=status_code, headers=headers,
                    media_type="application/json")


def job_path(job_id: str) -> str:
    """The job's URL path, used in links and the Location header."""
    return f"/v1/jobs/{job_id}"


class JobListPublic(BaseModel):
    """A page of jobs, newest first; pass `last_id` as `after` for the next page."""

    object: Literal["list"] = "list"
    data: list[JobPublic]
    first_id: str | None
    last_id: str | None
    has_more: bool
    # Jobs the filters take in all, across every page.
    total: int | None = None


class ModelPublic(BaseModel):
    """A served model, as OpenAI's `GET /v1/models` lists it, plus what it does.

    `kind` says which endpoints take it (`chat`: chat/completions and completions;
    `embedding`: embeddings). Context length and weights revision are null until a worker
    of the model has started and announced them.
    """

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batchinfer"
    kind: Literal["chat", "embedding"] = "chat"
    context_length: int | None = None
    revision: str | None = None
    # `loading` until a worker takes its jobs, then `ready`; `failed` once its workers
    # failed to load it MAX_LOAD_FAILURES times in a row (new jobs are refused, 503).
    # Null when Redis, which holds the states, does not answer.
    state: Literal["loading", "ready", "failed"] | None = None
    live_workers: int | None = None
    # The last failed load's error, while the model has no live worker.
    error: str | None = None


class ModelListPublic(BaseModel):
    """The models this deployment serves."""

    object: Literal["list"] = "list"
    data: list[ModelPublic]
