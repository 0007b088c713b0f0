"""Request bodies in OpenAI's field names plus our extras: one definition for every road in.

Responsible for: the shape of each request (types, ranges, unknown fields, text that is
valid Unicode), and the normalised body a worker runs (`inference_body`). The API
validates `POST /v1/jobs` and the OpenAI-compatible endpoints with these models, and the
scheduler validates each line of a batch file with the same ones, so both refuse alike.

Types are strict where OpenAI's are: integers are JSON integers (not `"8"`, `true` or
`1e30`), booleans are `true`/`false`, numbers are finite. What parses but is not supported
is refused by `core.request_checks`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)
from pydantic_core import PydanticCustomError

from core.topics import Priority
from core.webhook_urls import split_callback_url

MAX_STOP_SEQUENCES = 4
# OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_KEYS = 16
# No served context comes near 2**31 tokens; a larger count is a mistake, not a request,
# and bounding it keeps every integer a 64-bit column or a C++ engine can hold.
MAX_TOKENS_CEILING = 2**31 - 1


def check_text(text: object) -> object:
    """`text` unchanged unless it is a str that is not valid Unicode (PydanticCustomError).

    JSON may escape a lone UTF-16 surrogate (`"\\ud800"`); Python decodes it into a str
    that no UTF-8 encoder, database driver or tokenizer accepts, so it is refused here.
    It runs before pydantic's own string checks (whose length check would otherwise say
    only "unable to parse raw data"); anything not a str is left for them to refuse.
    """
    if not isinstance(text, str):
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "invalid_text",
            "text holds {character} at position {position}, a lone UTF-16 surrogate that is "
            "not valid Unicode; send valid UTF-8 text",
            {"character": f"U+{ord(text[e.start]):04X}", "position": e.start},
        ) from None
    return text


def printable(text: str) -> str:
    """`text` with every character UTF-8 cannot encode replaced by its backslash escape.

    For error messages and logs that quote client text: `"x\\ud800y"` stays readable and
    can be stored and sent.
    """
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_key(text: object) -> object:
    """`check_text`, and no NUL either (identifiers are kept in text columns)."""
    check_text(text)
    if isinstance(text, str) and "\x00" in text:
        raise PydanticCustomError(
            "invalid_text", "text holds a NUL character (U+0000), which identifiers may not "
            "contain", {})
    return text


def _as_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


def _check_callback_url(url: str) -> str:
    split_callback_url(url)
    return url


def _is_valid_text(value: object) -> bool:
    """False only for a str that UTF-8 cannot encode."""
    if not isinstance(value, str):
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_keys(value: object) -> object:
    """A dict's keys must be valid text; the error names the key (escaped), not a mangled one.

    Pydantic writes a dict key into the error location as lossily decoded text
    (U+FFFD for each bad byte), so the key is checked here, at the dict itself.
    """
    if isinstance(value, dict):
        for key in value:
            try:
                check_text(key)
            except PydanticCustomError as e:
                raise PydanticCustomError(
                    "invalid_text", "key '{key}': {problem}",
                    {"key": printable(str(key)), "problem": e.message()}) from None
    return value


# Every string a client sends is one of these, so none reaches storage or a tokenizer
# unchecked.
Text = Annotated[str, BeforeValidator(check_text)]
Key = Annotated[str, BeforeValidator(check_key)]
# Length bounds sit before the check: after it, pydantic counts a string's length in
# "items" ("Value should have at most 512 items after validation").
MetadataKey = Annotated[str, Field(max_length=64), BeforeValidator(check_key)]
MetadataValue = Annotated[str, Field(max_length=512), BeforeValidator(check_text)]
NonEmptyText = Annotated[str, Field(min_length=1), BeforeValidator(check_text)]
FunctionName = Annotated[str, Field(min_length=1, max_length=64), BeforeValidator(check_text)]
MessageName = Annotated[str, Field(max_length=64), BeforeValidator(check_text)]
CallId = Annotated[str, Field(min_length=1, max_length=256), BeforeValidator(check_text)]
UserId = Annotated[str, Field(max_length=256), BeforeValidator(check_text)]
Stop = Annotated[
    list[NonEmptyText],
    BeforeValidator(_as_list),
    Field(max_length=MAX_STOP_SEQUENCES),
]
Metadata = Annotated[
    dict[MetadataKey, MetadataValue],
    BeforeValidator(_check_keys),
    Field(max_length=MAX_METADATA_KEYS),
]
CallbackUrl = Annotated[Text, AfterValidator(_check_callback_url)]
ClientDict = Annotated[dict[str, Any], BeforeValidator(_check_keys)]
# vLLM's `chat_template_kwargs`: variables for the model's chat template (Qwen3's
# `enable_thinking: false`); checked in core.request_checks.
ChatTemplateKwargs = Annotated[dict[str, Any], BeforeValidator(_check_keys),
                               Field(max_length=64)]
Seed = Annotated[StrictInt, Field(ge=-(2**63), le=2**64 - 1)]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
MaxTokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_CEILING)]
PositiveInt = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_CEILING)]
# Ints are accepted for floats (JSON has one number type), strings and booleans are not,
# and NaN or infinity get "Input should be a finite number" rather than a range message.
Temperature = Annotated[float, Field(ge=0, le=2, strict=True, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, strict=True, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, strict=True, allow_inf_nan=False)]


def _one_prompt(value: object) -> object:
    """A list holding one prompt (OpenAI's array form) is that prompt; several are refused:
    each is its own job here, with its own id, priority and result."""
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        if len(value) > 1:
            raise ValueError(f"prompt holds {len(value)} prompts; send one per request (a "
                             "batch file takes many, one per line)")
        return value[0]
    return value


# A text prompt, or the token ids of one (OpenAI's `prompt` forms, one prompt each).
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]],
                     Field(min_length=1, max_length=MAX_TOKENS_CEILING)]
Prompt = Annotated[Text | TokenIds, BeforeValidator(_one_prompt)]


class ClientObject(BaseModel):
    """A JSON object from a client: a key that is not valid Unicode is named, escaped.

    Pydantic refuses such a key without saying where; escaped (`x\\ud800y`), it is an
    unknown field like any other and the error names it.
    """

    @model_validator(mode="before")
    @classmethod
    def _escape_bad_keys(cls, data: object) -> object:
        if isinstance(data, dict) and not all(_is_valid_text(k) for k in data):
            return {printable(k) if isinstance(k, str) else k: v for k, v in data.items()}
        return data


class ContentPart(ClientObject):
    """One part of a message's content; parts other than `text` are refused (400)."""

    model_config = ConfigDict(extra="allow")

    type: Text
    text: Text | None = None

    @model_validator(mode="after")
    def _text_has_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a content part of type 'text' needs a 'text' string")
        return self


class CalledFunction(ClientObject):
    """The function of an earlier tool call: its name and its arguments as JSON text."""

    model_config = ConfigDict(extra="forbid")

    name: FunctionName
    arguments: Text


class MessageToolCall(ClientObject):
    """A tool call an earlier assistant message made (sent back with its result)."""

    model_config = ConfigDict(extra="forbid")

    id: CallId
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(ClientObject):
    """One message of a chat conversation: a turn, an assistant's tool calls, or a tool's
    result (`role: "tool"`, answering one call by its `tool_call_id`)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: MessageName | None = None
    tool_calls: list[MessageToolCall] | None = Field(default=None, min_length=1, max_length=128)
    tool_call_id: CallId | None = None
    # What an answer's message carries and clients send back with it (appending the
    # returned message to the conversation); read, not used.
    refusal: Text | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has 'tool_calls'")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a message of role 'tool' needs the 'tool_call_id' it answers, "
                             "and only such a message has one")
        if self.content is None and not self.tool_calls:
            raise ValueError("'content' is required (null only in an assistant message with "
                             "'tool_calls')")
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)

    def body(self) -> dict[str, Any]:
        """The message as the worker renders it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class CachePolicyField(ClientObject):
    """`cache`: which caches may answer this request (see storage.cache_policy)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "off", "exact", "semantic"] = "auto"
    # Seconds this request's result is kept for later ones (30 days at most).
    ttl: Annotated[StrictInt, Field(ge=1, le=30 * 24 * 3600)] | None = None
    # Cosine similarity a semantic match needs; below 0.8 everything looks alike.
    threshold: Annotated[float, Field(ge=0.8, le=1, strict=True, allow_inf_nan=False)] | None = (
        None)
    # The chance of a wrong semantic answer accepted (calibrated; see storage.cache_policy).
    max_error: Annotated[float, Field(ge=0.0001, le=0.5, strict=True,
                                      allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _one_similarity_rule(self) -> CachePolicyField:
        if self.threshold is not None and self.max_error is not None:
            raise ValueError("give cache.max_error or cache.threshold, not both: max_error "
                             "bounds wrong answers, threshold is a raw cosine similarity")
        return self


class SamplingRequest(ClientObject):
    """Fields every request shares: the model, how to sample, when to stop, our extras."""

    model_config = ConfigDict(extra="forbid")

    model: Text = Field(min_length=1, max_length=200)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: PositiveInt | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: UserId | None = None
    stream: StrictBool | None = None
    # OpenAI's `store` keeps a completion for its dashboard; every request is a stored job
    # here, so it is read and changes nothing.
    store: StrictBool | None = None
    # OpenAI's lever between latency and cost, read as a queue priority where the request
    # sets none of its own (`requested_priority`).
    service_tier: ServiceTier | None = None
    metadata: Metadata | None = None
    # Our extras (vLLM's names for the sampling ones).
    top_k: PositiveInt | None = None
    ignore_eos: StrictBool | None = None
    # Jobs with the same cache_key land on the same partition, so the same worker's
    # prefix cache; without one the affinity key hashes the prompt's first block.
    cache_key: Key | None = Field(default=None, min_length=1, max_length=200)
    cache: CachePolicyField | None = None
    # Checked in core.request_checks and core.structured_outputs (token ids as keys;
    # schemas the grammar library can compile).
    logit_bias: Annotated[dict[str, float], BeforeValidator(_check_keys)] | None = None
    response_format: ClientDict | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    stream_options: ClientDict | None = None

    @property
    def num_max_tokens(self) -> int | None:
        """The output-length limit, whichever of OpenAI's two names carried it."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The name the output-length limit came under, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @property
    def kind(self) -> Literal["chat.completion", "text_completion"]:
        """The OpenAI object the job's result will be."""
        return "chat.completion" if getattr(self, "messages", None) else "text_completion"

    @property
    def prompt_param(self) -> str:
        """The field that carries the prompt: `messages` or `prompt`."""
        return "messages" if self.kind == "chat.completion" else "prompt"

    def inference_body(self) -> dict[str, Any]:
        """The normalised request a worker runs and the job row keeps.

        Chat content parts are joined into strings, `stop` is always a list, the output
        limit is `max_tokens` whichever name carried it, `logprobs` is a boolean (a text
        request's `0` asks for the sampled token's log-probability) and the alternatives
        per position are `top_logprobs` (a text request's `logprobs` count).
        """
        body: dict[str, Any] = {"model": self.model}
        messages: list[ChatMessage] | None = getattr(self, "messages", None)
        if messages:
            body["messages"] = [m.body() for m in messages]
            kwargs = getattr(self, "chat_template_kwargs", None)
            if kwargs:
                body["chat_template_kwargs"] = kwargs
        else:
            body["prompt"] = getattr(self, "prompt", None)
            if getattr(self, "echo", None):
                body["echo"] = True  # the result's text starts with the prompt
        body.update(self._sampling_fields())
        logprobs = getattr(self, "logprobs", None)
        if logprobs is not None and logprobs is not False:
            body["logprobs"] = True
            # Alternatives per position: chat's top_logprobs, or a text request's count.
            top = getattr(self, "top_logprobs", None) or (0 if logprobs is True else logprobs)
            if top:
                body["top_logprobs"] = top
        if self.stream:
            body["stream"] = True  # the worker publishes its tokens as they come
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
            "cache": self.cache.model_dump(exclude_none=True) if self.cache else None,
            "presence_penalty": self.presence_penalty or None,
            "frequency_penalty": self.frequency_penalty or None,
            "logit_bias": self.logit_bias or None,
            "response_format": self.response_format,
            "tools": self.tools or None,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "n": self.n if self.n != 1 else None,
        }
        return {name: value for name, value in fields.items() if value is not None}


# vLLM's `priority` on its OpenAI endpoints: lower runs first. This service's queue has
# three priorities, so 0 (and below) is high, 1 normal, 2 (and above) low; a worker in
# front of an engine server sends it (see docs/engine-servers.md).
ServerPriority = Annotated[StrictInt, Field(ge=-(2**31), le=2**31 - 1)]


def priority_of_rank(rank: int | None) -> Priority:
    """The queue priority of a vLLM-style `priority` (None: high, as these endpoints
    answer a waiting client)."""
    if rank is None or rank <= 0:
        return Priority.HIGH
    return Priority.NORMAL if rank == 1 else Priority.LOW


# OpenAI's service tiers: `priority` (faster, dearer) runs as `high`, `flex` (slower,
# cheaper: evaluations, enrichment) as `low`; `auto`, `default` and `scale` leave the
# endpoint's own default (high for a waiting client, normal for a job).
TIER_PRIORITIES = {"priority": Priority.HIGH, "flex": Priority.LOW}


def requested_priority(request: BaseModel, *, default: Priority) -> Priority:
    """The queue priority a request asks for: its own `priority` (vLLM's rank on the
    OpenAI endpoints, ours on a job) where sent, else its `service_tier`, else `default`.
    A request that sends both with a tier that moves it is refused (core.request_checks)."""
    if "priority" in request.model_fields_set:
        own = getattr(request, "priority", None)
        if isinstance(own, Priority):
            return own
        if own is not None:
            return priority_of_rank(own)
    return TIER_PRIORITIES.get(getattr(request, "service_tier", None) or "", default)


class ChatCompletionRequest(SamplingRequest):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    priority: ServerPriority | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None


class CompletionRequest(SamplingRequest):
    """Body of `POST /v1/completions`: one prompt, as text or token ids."""

    prompt: Prompt
    # Legacy completions: the number of alternatives per position; 0 = the sampled token.
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    echo: StrictBool | None = None
    suffix: Text | None = None
    best_of: PositiveInt | None = None
    priority: ServerPriority | None = None


class JobCreate(SamplingRequest):
    """Body of `POST /v1/jobs`: a chat (`messages`) or text (`prompt`) request, queued."""

    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: Prompt | None = None
    # A chat request's `true`/`false`, or a text request's alternatives count (0 only).
    logprobs: StrictBool | Annotated[StrictInt, Field(ge=0)] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    priority: Priority = Priority.NORMAL
    chat_template_kwargs: ChatTemplateKwargs | None = None
    # A text prompt's: the result's text (and logprobs) start with the prompt.
    echo: StrictBool | None = None
    callback_url: CallbackUrl | None = Field(default=None, max_length=2048)
    # When the job must be done by: an RFC 3339 time with its offset, or seconds from now
    # (1 minute to 7 days). Within a priority the earliest deadline runs first; a job
    # still unfinished at it is expired.
    deadline: StrictInt | StrictFloat | datetime | None = None
    # With a deadline the backlog cannot meet: `refuse` (409 deadline_unattainable, the
    # default) or `accept` it as best effort.
    on_unattainable: Literal["refuse", "accept"] | None = None


AnyRequest = ChatCompletionRequest | CompletionRequest | JobCreate
