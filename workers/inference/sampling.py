"""A job body (OpenAI request fields) → the engine's prompt and SamplingParams.

Every problem is a ValueError naming the field, so the worker fails that one job with a
message the user can act on and carries on with the others. The API validates bodies
too, but batch files and older messages reach workers by other roads.
"""

from __future__ import annotations

import json
from typing import Any

from core.request_checks import MAX_CHOICES
from core.structured_outputs import (
    StructuredOutputError,
    auto_tool_tag,
    output_schema,
    tool_mode,
)
from workers.engine import SamplingParams
from workers.engine.sampling_params import MAX_TOP_LOGPROBS

# OpenAI's default for legacy completions; chat requests default to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16

Prompt = str | list[int] | list[dict[str, Any]]


def prompt_from_body(kind: str, body: dict[str, Any]) -> Prompt:
    """The engine prompt: chat messages for `chat.completion`, text or token ids otherwise."""
    if kind in ("chat.completion", "response"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        checked = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            if message.get("content") is None and message.get("tool_calls"):
                # A batch line's assistant message with calls, as the client sent it.
                message = {**message, "content": ""}
            if not isinstance(message.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
            if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
                raise ValueError(f"messages[{i}]: a tool message needs its 'tool_call_id'")
            checked.append(message)
        return checked
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return list(prompt)
    raise ValueError("prompt must be one non-empty string or one non-empty list of token ids")


def num_choices(body: dict[str, Any]) -> int:
    """The choices a request asks for (`n`, default 1); ValueError outside 1..MAX_CHOICES."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"n must be an integer from 1 to {MAX_CHOICES}, got {n!r}")
    return n


def sampling_params_from_body(
    kind: str, body: dict[str, Any], *, max_model_len: int | None = None
) -> SamplingParams:
    """SamplingParams from OpenAI fields plus `top_k` and `ignore_eos`; ValueError on bad ones.

    `max_tokens` falls back to `max_completion_tokens`, then to OpenAI's default: 16 for
    text completions, the model's context (`max_model_len`) for chat.
    """
    num_choices(body)  # refuses a bad `n` with the other fields
    logprobs, top_logprobs = _logprobs(body)

    max_tokens = _optional_int(body, "max_tokens")
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_completion_tokens")
    if max_tokens is None:
        is_chat = kind in ("chat.completion", "response")
        max_tokens = max_model_len if is_chat and max_model_len else DEFAULT_COMPLETION_MAX_TOKENS
    temperature = _optional_float(body, "temperature")
    top_p = _optional_float(body, "top_p")
    try:
        schema, _ = output_schema(body)
        tag = auto_tool_tag(body)
    except StructuredOutputError as e:
        raise ValueError(str(e)) from e
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=_optional_int(body, "top_k"),
            seed=_optional_int(body, "seed"),
            stop=_stop(body),
            ignore_eos=_optional_bool(body, "ignore_eos") or False,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            # `echo` shows the prompt before the output; with logprobs, the prompt's too.
            prompt_logprobs=top_logprobs if logprobs and body.get("echo") is True else None,
            presence_penalty=_optional_float(body, "presence_penalty") or 0.0,
            frequency_penalty=_optional_float(body, "frequency_penalty") or 0.0,
            logit_bias=_logit_bias(body),
            json_schema=None if schema is None else json.dumps(schema),
            structural_tag=None if tag is None else json.dumps(tag),
        )
    except TypeError as e:
        raise ValueError(f"invalid sampling parameters: {e}") from e


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools to render into the prompt: none when `tool_choice` is `none`."""
    try:
        mode, _ = tool_mode(body.get("tools"), body.get("tool_choice"))
    except StructuredOutputError as e:
        raise ValueError(str(e)) from e
    return None if mode == "none" else list(body["tools"])


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must map token ids to numbers")
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"logit_bias must map token ids to numbers: {e}") from e


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError("stop must be a non-empty string or a list of non-empty strings")
    return list(stop)


def _logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    """(the sampled tokens' logprobs asked for, alternatives per position). Chat sends
    true/false and `top_logprobs`; legacy completions send a count of alternatives, 0 for
    the sampled token only."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if value is None or value is False:
        wanted, count = False, 0
    elif value is True:
        wanted, count = True, 0
    elif _is_int(value) and 0 <= value <= MAX_TOP_LOGPROBS:
        wanted, count = True, value
    else:
        raise ValueError(f"logprobs must be a boolean or a count in [0, {MAX_TOP_LOGPROBS}], "
                         f"got {value!r}")
    if top is not None and top != 0:
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top!r}")
        if not wanted:
            raise ValueError("top_logprobs needs logprobs: true")
        count = top
    return wanted, count


def _optional_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _optional_float(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _optional_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"{name} must be true or false, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
