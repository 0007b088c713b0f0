"""What this service supports of OpenAI's request fields: a 400 naming the field otherwise.

Shape errors (wrong type, out of range, unknown field) are pydantic's, a 422; here are the
requests that parse but ask for something the engine does not do (streaming, several
choices, penalties, tools, alternatives' log-probabilities, non-text content).
"""

from __future__ import annotations

from api.errors import InvalidRequest, NotFound
from api.schemas import ChatCompletionRequest, CompletionRequest, JobCreate

AnyRequest = ChatCompletionRequest | CompletionRequest | JobCreate

LOGPROBS_ALTERNATIVES = (
    "logprobs > 0 (alternatives per position) is not supported; logprobs=0 returns the "
    "sampled token's log-probability."
)


def check_supported(request: AnyRequest) -> None:
    """Refuse (InvalidRequest, naming the field) what parses but this service cannot do."""
    if request.stream:
        raise InvalidRequest(
            "stream is not supported: results are returned whole (poll or long-poll jobs "
            "with GET /v1/jobs/{id}?wait=N).", param="stream", code="unsupported_parameter")
    _only(request.n in (None, 1), "n", "n must be 1: one choice is returned per request.")
    for penalty in ("presence_penalty", "frequency_penalty"):
        _only(getattr(request, penalty) in (None, 0), penalty,
              f"{penalty} is not supported; only 0 is accepted.")
    if (request.max_tokens is not None and request.max_completion_tokens is not None
            and request.max_tokens != request.max_completion_tokens):
        raise InvalidRequest("Set max_completion_tokens or max_tokens, not both with different "
                             "values.", param="max_completion_tokens")
    _only(not request.logit_bias, "logit_bias", "logit_bias is not supported.")
    _only(request.response_format is None or request.response_format.get("type") == "text",
          "response_format", "response_format is not supported; output is plain text.")
    _only(not request.tools, "tools", "tools (function calling) are not supported.")
    _only(request.tool_choice in (None, "none", "auto"), "tool_choice",
          "tool_choice is not supported: tools are not supported.")
    _only(request.stream_options is None, "stream_options",
          "stream_options is not supported: stream is not supported.")
    if isinstance(request, CompletionRequest):
        _check_completion_extras(request)
    else:
        _check_chat_extras(request)


def _check_completion_extras(request: CompletionRequest) -> None:
    _only(not request.echo, "echo", "echo is not supported.")
    _only(not request.suffix, "suffix", "suffix (insertion) is not supported.")
    _only(request.best_of in (None, 1), "best_of", "best_of must be 1.")
    _only(not request.logprobs, "logprobs", LOGPROBS_ALTERNATIVES)


def _check_chat_extras(request: ChatCompletionRequest | JobCreate) -> None:
    _only(not request.top_logprobs, "top_logprobs",
          "top_logprobs > 0 is not supported: only the sampled token's log-probability is "
          "returned (logprobs=true).")
    if isinstance(request, JobCreate):
        if (request.messages is None) == (request.prompt is None):
            raise InvalidRequest("Provide exactly one of 'messages' (a chat request) or "
                                 "'prompt' (a text completion).", param="messages")
        if request.prompt is not None:
            _only(request.logprobs in (None, False, 0), "logprobs", LOGPROBS_ALTERNATIVES)
    for i, message in enumerate(request.messages or []):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                _only(part.type == "text", f"messages[{i}].content[{j}].type",
                      f"Content parts of type {part.type!r} are not supported; only 'text'.")


def _only(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(message, param=param, code="unsupported_parameter")


def check_model(model: str, served_models: list[str]) -> None:
    """404 model_not_found (as OpenAI answers) unless this deployment serves `model`."""
    if model not in served_models:
        raise NotFound(
            f"The model '{model}' does not exist; this deployment serves "
            f"{', '.join(repr(m) for m in served_models)} (see GET /v1/models).",
            param="model", code="model_not_found")
