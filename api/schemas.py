"""Bodies of the public API: requests in OpenAI's field names plus our extras, and views.

Responsible for: the shape of each request (types, ranges, unknown fields; pydantic turns
violations into a 422 naming the field), the normalised body a worker runs
(`inference_body`), and the public views of jobs and models. What parses but is not
supported is refused by `api.capabilities` (400).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from core.topics import Priority
from core.webhook_urls import split_callback_url
from storage.files import MAX_EXPIRES_AFTER_S, MIN_EXPIRES_AFTER_S
from storage.models import Job, JobStatus, unix_seconds

MAX_STOP_SEQUENCES = 4
# OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_KEYS = 16


def _as_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


def _check_callback_url(url: str) -> str:
    split_callback_url(url)
    return url


class ExpiresAfter(BaseModel):
    """OpenAI's expiry policy for a file: `seconds` after `anchor` (only `created_at`)."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRES_AFTER_S, le=MAX_EXPIRES_AFTER_S)


Stop = Annotated[
    list[Annotated[str, Field(min_length=1)]],
    BeforeValidator(_as_list),
    Field(max_length=MAX_STOP_SEQUENCES),
]
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=MAX_METADATA_KEYS),
]
CallbackUrl = Annotated[str, AfterValidator(_check_callback_url)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


class ContentPart(BaseModel):
    """One part of a message's content; parts other than `text` are refused (400)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_has_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a content part of type 'text' needs a 'text' string")
        return self


class ChatMessage(BaseModel):
    """One message of a chat conversation."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = Field(default=None, max_length=64)

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


class SamplingRequest(BaseModel):
    """Fields every request shares: the model, how to sample, when to stop, our extras."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    seed: Seed | None = None
    stop: Stop | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = Field(default=None, max_length=256)
    stream: bool | None = None
    metadata: Metadata | None = None
    # Our extras (vLLM's names for the sampling ones).
    top_k: int | None = Field(default=None, ge=1)
    ignore_eos: bool | None = None
    # Jobs with the same cache_key land on the same partition, so the same worker's
    # prefix cache; without one the affinity key hashes the prompt's first block.
    cache_key: str | None = Field(default=None, min_length=1, max_length=200)
    # OpenAI fields this service does not implement. They are declared so that a null or
    # empty value (which some clients send by default) passes; anything else is a 400.
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream_options: dict[str, Any] | None = None

    @property
    def num_max_tokens(self) -> int | None:
        """The output-length limit, whichever of OpenAI's two names carried it."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def kind(self) -> Literal["chat.completion", "text_completion"]:
        """The OpenAI object the job's result will be."""
        return "chat.completion" if getattr(self, "messages", None) else "text_completion"

    def inference_body(self) -> dict[str, Any]:
        """The normalised request a worker runs and the job row keeps.

        Chat content parts are joined into strings, `stop` is always a list, the output
        limit is `max_tokens` whichever name carried it, and `logprobs` is a boolean
        (a text request's `0` asks for the sampled token's log-probability).
        """
        body: dict[str, Any] = {"model": self.model}
        messages: list[ChatMessage] | None = getattr(self, "messages", None)
        if messages:
            body["messages"] = [
                {"role": m.role, "content": m.text} | ({"name": m.name} if m.name else {})
                for m in messages
            ]
        else:
            body["prompt"] = getattr(self, "prompt", None)
        body.update(self._sampling_fields())
        logprobs = getattr(self, "logprobs", None)
        if logprobs is not None and logprobs is not False:
            body["logprobs"] = True
        return body

    def _sampling_fields(self) -> dict[str, Any]:
        fields = {
            "max_tokens": self.num_max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "ignore_eos": self.ignore_eos,
            "user": self.user,
        }
        return {name: value for name, value in fields.items() if value is not None}


class ChatCompletionRequest(SamplingRequest):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(SamplingRequest):
    """Body of `POST /v1/completions` (a single string prompt)."""

    prompt: str
    # Legacy completions: the number of alternatives per position; 0 = the sampled token.
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


class JobCreate(SamplingRequest):
    """Body of `POST /v1/jobs`: a chat (`messages`) or text (`prompt`) request, queued."""

    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: str | None = None
    # A chat request's `true`/`false`, or a text request's alternatives count (0 only).
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    priority: Priority = Priority.NORMAL
    callback_url: CallbackUrl | None = Field(default=None, max_length=2048)


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
    links: JobLinks

    @classmethod
    def from_job(cls, job: Job) -> JobPublic:
        """The public view of a job row."""
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
            links=JobLinks.model_validate({"self": path, "cancel": f"{path}/cancel"}),
        )


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


class ModelListPublic(BaseModel):
    """The models this deployment serves."""

    object: Literal["list"] = "list"
    data: list[ModelPublic]
