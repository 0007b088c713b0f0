"""The checks every request passes before it is stored: one function for every road in.

Responsible for: what parses but this service does not support (streaming where it is
not relayed, too many choices, non-text content), structured-output schemas
and tools the grammar library cannot enforce, the limits
of the model's context (`max_tokens` and the prompt, counted with the model's tokenizer
when this machine has it), and turning pydantic's errors into the name of the offending
field. `POST /v1/jobs`, the OpenAI-compatible endpoints and each line of a batch file go
through `check_request`, so a request the API would refuse never reaches a worker by
another road. Errors are `RequestRefused` (a ValueError); the API maps them to 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from core.model_context import ModelContext, PromptRenderError
from core.requests import (
    TIER_PRIORITIES,
    AnyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    JobCreate,
)
from core.structured_outputs import StructuredOutputError, check_output_schema

# Alternatives per position a text completion may ask for in `logprobs` (OpenAI's bound).
MAX_TEXT_LOGPROBS = 5

# Token ids one request may bias.
MAX_LOGIT_BIAS_ENTRIES = 300
# Choices one request may ask for (`n`), OpenAI's own bound.
MAX_CHOICES = 128


class RequestRefused(ValueError):
    """A request this service will not run, naming the field and an OpenAI error code.

    `status_code` is what the API answers: 400 for a body that does not match the schema
    and for a well-formed request it will not run (OpenAI's status for both).
    """

    def __init__(self, message: str, *, param: str | None, code: str = "invalid_value",
                 status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = status_code

    def error_object(self) -> dict[str, Any]:
        """OpenAI's error object plus `status_code`, as a failed job stores it."""
        return {"message": self.message, "type": "invalid_request_error", "param": self.param,
                "code": self.code, "status_code": self.status_code}


def check_request(request: AnyRequest, context: ModelContext | None) -> None:
    """Everything a worker would refuse, refused now (RequestRefused naming the field)."""
    check_supported(request)
    check_context(request, context)


def check_supported(request: AnyRequest, *, can_stream: bool = False) -> None:
    """Refuse (RequestRefused, naming the field) what parses but this service cannot do;
    `stream` only where the caller relays it (the OpenAI-compatible endpoints)."""
    _check_stream(request, can_stream=can_stream)
    _only(request.service_tier not in TIER_PRIORITIES
          or getattr(request, "priority", None) is None
          or "priority" not in request.model_fields_set, "service_tier",
          "Set priority or service_tier, not both: each picks the queue priority.")
    _only(request.n is None or request.n <= MAX_CHOICES, "n",
          f"n may be at most {MAX_CHOICES} choices per request.")
    if (request.max_tokens is not None and request.max_completion_tokens is not None
            and request.max_tokens != request.max_completion_tokens):
        raise RequestRefused("Set max_completion_tokens or max_tokens, not both with different "
                             "values.", param="max_completion_tokens")
    _check_logit_bias(request.logit_bias)
    _check_template_kwargs(request)
    _only(not request.tools or bool(getattr(request, "messages", None)), "tools",
          "tools need a chat request (messages).")
    try:
        check_output_schema(request.model_dump(
            include={"response_format", "tools", "tool_choice", "parallel_tool_calls"}))
    except StructuredOutputError as e:
        raise RequestRefused(str(e), param=e.param) from e
    if isinstance(request, CompletionRequest):
        _check_completion_extras(request)
    else:
        _check_chat_extras(request)
    if getattr(request, "prompt", None) == "":
        raise RequestRefused("prompt must not be empty.", param="prompt")


def _check_logit_bias(logit_bias: dict[str, float] | None) -> None:
    """OpenAI's shape: token ids (as JSON keys) to biases in [-100, 100], at most
    MAX_LOGIT_BIAS_ENTRIES of them (each one is sampler work on every step of the job)."""
    if logit_bias and len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestRefused(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                             f"got {len(logit_bias)}.", param="logit_bias")
    for key, bias in (logit_bias or {}).items():
        if not key.isdigit():
            raise RequestRefused(f"logit_bias keys must be token ids, got {key!r}.",
                                 param="logit_bias")
        if not -100 <= bias <= 100:
            raise RequestRefused(f"logit_bias values must be in [-100, 100], got {bias!r} "
                                 f"for token {key}.", param="logit_bias")


def _check_completion_extras(request: CompletionRequest) -> None:
    _only(not (request.echo and request.stream), "echo",
          "echo is not supported with stream; ask without stream for the prompt echoed.")
    _only(not request.suffix, "suffix", "suffix (insertion) is not supported.")
    _only(request.best_of in (None, 1), "best_of", "best_of must be 1.")


def _check_chat_extras(request: ChatCompletionRequest | JobCreate) -> None:
    _only(not getattr(request, "echo", None) or not request.messages, "echo",
          "echo is for a text prompt; a chat request has none.")
    if request.top_logprobs and request.logprobs is not True:
        raise RequestRefused("top_logprobs requires logprobs to be true.",
                             param="top_logprobs")
    if isinstance(request, JobCreate):
        if (request.messages is None) == (request.prompt is None):
            raise RequestRefused("Provide exactly one of 'messages' (a chat request) or "
                                 "'prompt' (a text completion).", param="messages")
        logprobs = request.logprobs
        if isinstance(logprobs, int) and not isinstance(logprobs, bool):
            # A count of alternatives is the text completions' form of logprobs.
            if request.prompt is None or logprobs > MAX_TEXT_LOGPROBS:
                raise RequestRefused(
                    f"logprobs as a count (0-{MAX_TEXT_LOGPROBS} alternatives per position) "
                    "is for a text 'prompt'; a chat request takes logprobs: true and "
                    "top_logprobs.", param="logprobs")
    called: set[str] = set()
    for i, message in enumerate(request.messages or []):
        called.update(call.id for call in message.tool_calls or [])
        if message.role == "tool" and message.tool_call_id not in called:
            raise RequestRefused(
                "messages with role 'tool' must answer a tool call of an earlier assistant "
                f"message: tool_call_id {message.tool_call_id!r} matches none.",
                param=f"messages[{i}].tool_call_id")
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                _only(part.type == "text", f"messages[{i}].content[{j}].type",
                      f"Content parts of type {part.type!r} are not supported; only 'text'.")


def _check_stream(request: AnyRequest, *, can_stream: bool) -> None:
    if request.stream and not can_stream:
        raise RequestRefused(
            "stream is only supported on POST /v1/chat/completions and /v1/completions; "
            "follow a job's tokens with GET /v1/jobs/{id}/events, or long-poll it with "
            "GET /v1/jobs/{id}?wait=N.", param="stream", code="unsupported_parameter")
    options = request.stream_options
    if options is None:
        return
    _only(bool(request.stream), "stream_options",
          "stream_options is only allowed with stream: true.")
    for name, value in options.items():
        _only(name == "include_usage", f"stream_options.{name}",
              f"stream_options.{name} is not supported; only include_usage is.")
        _only(isinstance(value, bool), "stream_options.include_usage",
              "stream_options.include_usage must be true or false.")


# Arguments of `apply_chat_template` itself, which a request's template variables must not
# replace: they would change what is rendered (or returned) rather than fill the template.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
})


def _check_template_kwargs(request: AnyRequest) -> None:
    kwargs = getattr(request, "chat_template_kwargs", None)
    if not kwargs:
        return
    _only(bool(getattr(request, "messages", None)), "chat_template_kwargs",
          "chat_template_kwargs need a chat request (messages).")
    for name in kwargs:
        _only(name not in RESERVED_TEMPLATE_KWARGS, f"chat_template_kwargs.{name}",
              f"chat_template_kwargs.{name} is an argument of the template renderer, "
              "which the service sets; give only the template's own variables.")
        _only(name.isidentifier(), f"chat_template_kwargs.{name}",
              f"chat_template_kwargs.{name} is not a template variable name.")


def _only(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise RequestRefused(message, param=param, code="unsupported_parameter")


def check_context(request: AnyRequest, context: ModelContext | None) -> None:
    """`max_tokens`, and the prompt with it, within the model's context (when it is known).

    As OpenAI and vLLM answer: a prompt plus the requested completion longer than the
    context is refused (`context_length_exceeded`) rather than cut short; without
    `max_tokens` the prompt alone must fit, and the completion takes what is left.
    """
    if context is None:
        return
    check_token_ids(request, context.vocab_size)
    if context.max_model_len is None:
        return
    limit = context.max_model_len
    max_tokens = request.num_max_tokens
    if max_tokens is not None and max_tokens > limit:
        raise RequestRefused(
            f"{request.max_tokens_param} is too large: {max_tokens}. The model "
            f"'{request.model}' has a context of {limit} tokens, prompt included; ask for "
            f"at most {limit} (fewer, by the prompt's length).",
            param=request.max_tokens_param)
    body = request.inference_body()
    if context.surely_fits(body, max_tokens):
        return
    try:
        num_prompt_tokens = context.count_prompt_tokens(body)
    except PromptRenderError as e:
        raise RequestRefused(str(e), param="messages") from e
    if num_prompt_tokens is None:
        return
    num_total = num_prompt_tokens + (max_tokens or 0)
    if num_total > limit:
        param = request.prompt_param
        raise RequestRefused(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_total} tokens ({num_prompt_tokens} in the {param}, {max_tokens or 0} in "
            f"the completion). Please reduce the length of the {param} or completion.",
            param=param, code="context_length_exceeded")


def check_token_ids(request: AnyRequest, vocab_size: int | None) -> None:
    """Token ids in a prompt or `logit_bias` that the model has (the engine's own check,
    made at submission so nothing is queued for a request that must fail)."""
    if vocab_size is None:
        return
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # a one-element list of a token-id prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise RequestRefused(f"prompt has token ids outside [0, {vocab_size}) of model "
                                 f"'{request.model}': {bad[:5]}", param="prompt")
    bad_bias = [k for k in (request.logit_bias or {}) if not 0 <= int(k) < vocab_size]
    if bad_bias:
        raise RequestRefused(f"logit_bias has token ids outside [0, {vocab_size}) of model "
                             f"'{request.model}': {bad_bias[:5]}", param="logit_bias")


def parse_body(body: dict[str, Any], *, is_chat: bool) -> ChatCompletionRequest | CompletionRequest:
    """A batch line's body as the endpoint's request model; RequestRefused naming the field."""
    model = ChatCompletionRequest if is_chat else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        param, message, code = describe_errors(e.errors(include_url=False))
        raise RequestRefused(message, param=param, code=code) from e


def param_from_loc(loc: Sequence[int | str]) -> str | None:
    """`("body", "messages", 0, "content")` → `"messages[0].content"`.

    Pydantic puts the member of a union it tried into the location (`"str"`,
    `"list[ContentPart]"`, ...); those are type names, not fields, and are left out.
    A header keeps its own name (`("header", "Idempotency-Key")` → `"Idempotency-Key"`).
    """
    if loc and loc[0] == "header":
        return "".join(str(part) for part in loc[1:2]) or None
    parts = list(loc[1:]) if loc and loc[0] in ("body", "query", "path") else list(loc)
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        elif _is_union_tag(part):
            continue
        else:
            param += f".{part}" if param else part
    return param or None


def _is_union_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "list", "dict") or any(
        c in part for c in "[](),"
    ) or part[:1].isupper()


def describe_errors(errors: Sequence[Any]) -> tuple[str | None, str, str]:
    """(param, message, code) for pydantic's error list: the first field's problems."""
    if not errors:
        return None, "Invalid request.", "invalid_value"
    first = first_error(errors)
    kind = str(first.get("type", ""))
    param = param_from_loc(tuple(first.get("loc", ())))
    if kind == "missing":
        return param, f"Missing required parameter: '{param}'.", "missing_required_parameter"
    if kind == "extra_forbidden":
        return param, f"Unrecognized request argument supplied: '{param}'.", "unknown_parameter"
    # A union reports one message per member; keep the distinct ones for this field, and
    # only the value errors when there are some: "should be a valid list" says nothing
    # useful about a string that was refused for its content.
    same_field = [e for e in errors if param_from_loc(tuple(e.get("loc", ()))) == param]
    messages: list[str] = []
    for e in [e for e in same_field if not _is_type_error(e)] or same_field:
        if e.get("msg") not in messages:
            messages.append(str(e.get("msg")))
    return param, f"Invalid value for '{param}': {'; or '.join(messages)}.", "invalid_value"


def first_error(errors: Sequence[Any]) -> Any:
    """The error to report: the first refused value, else the deepest wrong type.

    A union's members each report: for `content: str | list[parts]`, a bad part's text
    comes after "content should be a valid string". The value error is the one to name.
    Of wrong types only, the deepest is where the value went wrong: for `input: str |
    list[messages]` given a list whose message has `content: 7`, the list member's report
    names `input[0].content`, the string member's only `input`.
    """
    value_errors = [e for e in errors if not _is_type_error(e)]
    if value_errors:
        return value_errors[0]
    return max(errors, key=lambda e: len(e.get("loc", ())))


def _is_type_error(error: Any) -> bool:
    """A wrong-type report (`int_type`, `list_type`, ...), as opposed to a refused value."""
    return str(error.get("type", "")).endswith("_type")
