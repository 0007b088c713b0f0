"""OpenAI Responses bodies (`/v1/responses`) in the subset the engine honours.

Responsible for: the shape of a Responses request (text `input` or input messages,
`instructions`, `max_output_tokens`, `text.format` for structured output, `temperature`,
`top_p`, `metadata`, `user`, `store`), refusing the rest by name, and turning it into the
chat body a worker runs (`to_chat_body`). The worker answers such a job with a Responses
object (`object: "response"`); see workers/inference/results.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictBool, ValidationError

from core.request_checks import RequestRefused, describe_errors
from core.requests import (
    ClientDict,
    ClientObject,
    MaxTokens,
    Metadata,
    ServiceTier,
    Temperature,
    Text,
    TopP,
    UserId,
)


class InputPart(ClientObject):
    """One part of an input message's content; only text parts are supported."""

    model_config = ConfigDict(extra="allow")

    type: Text
    text: Text | None = None


class InputMessage(ClientObject):
    """One item of `input`: a message (`type` may be omitted, as the API allows)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[InputPart]


class ResponseRequest(ClientObject):
    """Body of a `/v1/responses` request (batch line)."""

    model_config = ConfigDict(extra="forbid")

    model: Text = Field(min_length=1, max_length=200)
    input: Text | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: ClientDict | None = None
    metadata: Metadata | None = None
    user: UserId | None = None
    store: StrictBool | None = None  # accepted; results are kept as every job's are
    service_tier: ServiceTier | None = None  # a queue priority (core.requests)
    # This service's own: the result and semantic caches' options, as on a chat request.
    cache: ClientDict | None = None


# List fields whose empty value asks for nothing.
_EMPTY_MEANS_UNSET = frozenset({"include", "tools"})
# Flags whose false asks for nothing (a batch line that says `stream: false` runs as one
# that leaves it out; `true` there is refused by name: nothing would read the stream).
_FALSE_MEANS_UNSET = frozenset({"stream", "background"})


def to_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body that runs a Responses body; RequestRefused naming the field.

    A field sent as null, and `include` or `tools` sent empty, count as not sent: client
    libraries send `previous_response_id: null` or `include: []` for what they leave
    unset, and OpenAI reads them so; refused by name, they would refuse every request."""
    body = {k: v for k, v in body.items()
            if v is not None and not (k in _EMPTY_MEANS_UNSET and v == [])
            and not (k in _FALSE_MEANS_UNSET and v is False)}
    try:
        request = ResponseRequest.model_validate(body)
    except ValidationError as e:
        param, message, code = describe_errors(e.errors(include_url=False))
        raise RequestRefused(message, param=param, code=code) from e
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        for i, item in enumerate(request.input):
            messages.append({"role": item.role, "content": _text_of(item, i)})
    chat: dict[str, Any] = {"model": request.model, "messages": messages}
    optional = {
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "metadata": request.metadata,
        "user": request.user,
        "service_tier": request.service_tier,
        "response_format": _response_format(request.text),
        "cache": request.cache,
    }
    chat.update({k: v for k, v in optional.items() if v is not None})
    return chat


def _text_of(item: InputMessage, index: int) -> str:
    if isinstance(item.content, str):
        return item.content
    if not item.content:
        raise RequestRefused("A message's content must be a string or at least one part.",
                             param=f"input[{index}].content")
    texts = []
    for j, part in enumerate(item.content):
        if part.type not in ("input_text", "output_text"):
            raise RequestRefused(
                f"Content parts of type {part.type!r} are not supported; only 'input_text' "
                "and 'output_text'.", param=f"input[{index}].content[{j}].type",
                code="unsupported_parameter")
        if part.text is None:
            raise RequestRefused(f"A part of type {part.type!r} needs its 'text'.",
                                 param=f"input[{index}].content[{j}].text",
                                 code="missing_required_parameter")
        texts.append(part.text)
    return "\n".join(texts)


# The fields of each `text.format` type (OpenAI's ResponseFormatTextConfig).
_FORMAT_FIELDS = {
    "text": {"type"}, "json_object": {"type"},
    "json_schema": {"type", "name", "schema", "strict", "description"},
}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` (flat, Responses style) → chat's `response_format` (nested)."""
    if not text:
        return None
    unknown = set(text) - {"format"}
    if unknown:
        raise RequestRefused(f"text.{sorted(unknown)[0]} is not supported.",
                             param=f"text.{sorted(unknown)[0]}", code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestRefused("text.format must be an object with a 'type'.", param="text.format")
    known = _FORMAT_FIELDS.get(str(fmt.get("type")))
    extra = sorted(set(fmt) - known) if known is not None else []
    if extra:  # as OpenAI's: a misspelt `strict` must not pass as absent
        raise RequestRefused(f"Unrecognized request argument supplied: 'text.format."
                             f"{extra[0]}'.", param=f"text.format.{extra[0]}",
                             code="unknown_parameter")
    if fmt.get("type") != "json_schema":
        return dict(fmt)  # text / json_object (anything else is refused by name later)
    # Named here as the Responses API names them (the chat checks after would say
    # `response_format.json_schema`); unlike chat's, this format has no default schema.
    if not isinstance(fmt.get("name"), str):
        raise RequestRefused("text.format.name must be a string naming the schema.",
                             param="text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise RequestRefused("text.format.schema must be a JSON Schema object.",
                             param="text.format.schema")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


# A Responses body runs as a chat body: what the chat checks name, as the Responses API
# names it. Message positions are left out (`instructions` come first as a message).
_CHAT_NAMES = re.compile(
    r"\bmax_completion_tokens\b|\bmax_tokens\b"
    r"|\bresponse_format(?:\.json_schema)?(?:\.(?:schema|type|strict|name)\b)?"
    r"|\bmessages(?:\[\d+\])?(?:\.\w+)?|\bprompt\b")


def _responses_name(match: re.Match[str]) -> str:
    name = match.group(0)
    if name in ("max_completion_tokens", "max_tokens"):
        return "max_output_tokens"
    if name.startswith("response_format"):
        field = name.rsplit(".", 1)[-1]
        return f"text.format.{field}" if field in ("schema", "type", "strict", "name") else (
            "text.format")
    return "input"


def responses_names(text: str) -> str:
    """`text` (an error's message or param from the chat checks that run a Responses
    body) with chat's field names as the Responses API names them."""
    return _CHAT_NAMES.sub(_responses_name, text)


def as_responses_refusal(e: RequestRefused) -> RequestRefused:
    """`e`, raised by the chat checks of a Responses body, naming the Responses fields."""
    param = None if e.param is None else responses_names(e.param)
    return RequestRefused(responses_names(e.message), param=param, code=e.code,
                          status_code=e.status_code)


# The key of a Responses job's body that keeps its `instructions` for the `response` to
# echo (they run as the chat body's first system message).
ECHOED_INSTRUCTIONS = "instructions"


def response_shell(*, job_id: str, model: str | None, created_at: int | None,
                   body: dict[str, Any]) -> dict[str, Any]:
    """The `response` of job `job_id` before it has output: in progress, no usage yet.

    Streams open with it (`response.created`); `response_object` fills it in."""
    return {
        "id": f"resp_{job_id}",
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "incomplete_details": None,
        "error": None,
        "model": model,
        "output": [],
        "usage": None,
        "max_output_tokens": body.get("max_completion_tokens") or body.get("max_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "metadata": body.get("metadata") or {},
        "instructions": body.get(ECHOED_INSTRUCTIONS),
        "background": body.get("background") is True,
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
    }


# What a `response` echoes of its request (response_shell): a cached answer to an equal
# request carries the earlier request's, to be replaced by this one's.
ECHOED_FIELDS = ("max_output_tokens", "temperature", "top_p", "metadata", "instructions",
                 "background")


def with_request_echoed(response: dict[str, Any], *, job_id: str,
                        body: dict[str, Any]) -> dict[str, Any]:
    """`response` (another job's, from the cache) echoing job `job_id`'s request `body`."""
    shell = response_shell(job_id=job_id, model=response.get("model"), created_at=None,
                           body=body)
    return {**response, **{name: shell[name] for name in ECHOED_FIELDS}}


def response_object(chat_result: dict[str, Any], *, job_id: str, body: dict[str, Any]
                    ) -> dict[str, Any]:
    """A finished chat.completion result reshaped as the Responses API's `response`."""
    choice = chat_result["choices"][0]
    text = choice["message"].get("content") or ""
    usage = chat_result.get("usage") or {}
    is_cut = choice.get("finish_reason") == "length"
    response = response_shell(job_id=job_id, model=chat_result.get("model"),
                              created_at=chat_result.get("created"), body=body)
    response.update({
        "status": "incomplete" if is_cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if is_cut else None,
        "output": [{
            "type": "message", "id": f"msg_{job_id}", "status": "incomplete" if is_cut
            else "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }],
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {
                "cached_tokens": (usage.get("prompt_tokens_details") or {})
                .get("cached_tokens", 0),
                "cache_write_tokens": 0},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0),
        },
    })
    return response


def input_items(body: dict[str, Any], *, job_id: str) -> list[dict[str, Any]]:
    """The `input` of a Responses job as OpenAI lists it back (`input_items`), oldest
    first, from the chat body it ran as (`to_chat_body`): its messages less the system
    message its `instructions` became. A message's text parts come back as one part, as
    they ran (joined by newlines). Ids are `msg_<job id>_<position in input>`."""
    messages = list(body.get("messages") or [])
    if body.get(ECHOED_INSTRUCTIONS):
        messages = messages[1:]
    items = []
    for i, message in enumerate(messages):
        role = message.get("role")
        content = message.get("content")
        text = content if isinstance(content, str) else ""
        item: dict[str, Any] = {"id": f"msg_{job_id}_{i}", "type": "message", "role": role,
                                "status": "completed"}
        if role == "assistant":  # an earlier answer passed back in: output text
            item["content"] = [{"type": "output_text", "text": text, "annotations": []}]
        else:
            item["content"] = [{"type": "input_text", "text": text}]
        items.append(item)
    return items


def response_text(response: dict[str, Any]) -> str:
    """The output text of a stored `response` object (its message's text parts, joined)."""
    return "".join(part.get("text") or "" for item in response.get("output") or []
                   if item.get("type") == "message" for part in item.get("content") or []
                   if part.get("type") == "output_text")
