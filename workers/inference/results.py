"""A finished engine output → the OpenAI response object stored as the job's result.

`chat.completion` jobs get `choices[i].message`; `text_completion` jobs get
`choices[i].text`, one choice per `n`. Both carry `finish_reason` and `usage`, with the
prefix-cache hits in `usage.prompt_tokens_details.cached_tokens` as OpenAI reports cached
prompt tokens.
Error bodies use the inner object of the API's error shape (`message`, `type`, `param`,
`code`), which is what batch error files and `GET /v1/jobs/{id}` show.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from core.responses_api import response_object

# The engine says "abort" for a cancelled request; such a job has no result to shape.
OPENAI_FINISH_REASONS = {"stop": "stop", "length": "length"}


@dataclass(slots=True)
class EchoedPrompt:
    """The prompt of an `echo` request: its text and tokens, and with logprobs each
    token's given those before it (None for the first) and the alternatives there."""

    text: str
    token_ids: list[int]
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass(slots=True)
class Completion:
    """What a finished request produced, in engine-neutral terms."""

    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[float] | None = None
    # Per generated token, the most likely (token id, logprob) of its step, when asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # A text completion with `echo`: the prompt shown before the output.
    echo: EchoedPrompt | None = None

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated."""
        return len(self.token_ids)


def usage_of(completion: Completion, others: Sequence[Completion] = ()) -> dict[str, Any]:
    """OpenAI's `usage` object: the prompt once, the tokens of every choice."""
    completion_tokens = completion.num_output_tokens + sum(c.num_output_tokens for c in others)
    return {
        "prompt_tokens": completion.num_prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": completion.num_prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": completion.num_cached_tokens},
    }


def build_result(
    kind: str,
    *,
    job_id: str,
    model: str,
    completion: Completion,
    created: int,
    token_text: Callable[[int], str] | None = None,
    system_fingerprint: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    body: dict[str, Any] | None = None,
    others: Sequence[tuple[Completion, list[dict[str, Any]] | None]] = (),
) -> dict[str, Any]:
    """The `chat.completion` or `text_completion` object for a finished job.

    `token_text` renders one token id as text; it is needed only when logprobs were asked
    for (OpenAI lists each sampled token next to its log-probability). With `tool_calls`
    the message carries them instead of content, and the finish reason says so. `others`
    are the choices after the first of a request with `n` > 1, each with its tool calls.
    """
    if kind == "response":  # a /v1/responses batch line: the chat result, reshaped
        chat = build_result("chat.completion", job_id=job_id, model=model,
                            completion=completion, created=created,
                            system_fingerprint=system_fingerprint)
        return response_object(chat, job_id=job_id, body=body or {})
    if kind == "chat.completion":
        object_name, id_prefix = "chat.completion", "chatcmpl"
    elif kind == "text_completion":
        object_name, id_prefix = "text_completion", "cmpl"
    else:
        raise ValueError(f"job kind must be chat.completion or text_completion, got {kind!r}")
    choices = [_choice(kind, index, choice, calls, token_text) for index, (choice, calls)
               in enumerate([(completion, tool_calls), *others])]
    return {
        "id": f"{id_prefix}-{job_id}",
        "object": object_name,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_of(completion, [c for c, _ in others]),
        "system_fingerprint": system_fingerprint,
    }


def _choice(kind: str, index: int, completion: Completion,
            tool_calls: list[dict[str, Any]] | None,
            token_text: Callable[[int], str] | None) -> dict[str, Any]:
    if completion.finish_reason not in OPENAI_FINISH_REASONS:
        raise ValueError(f"no result for finish_reason {completion.finish_reason!r}")
    finish_reason = OPENAI_FINISH_REASONS[completion.finish_reason]
    tokens = _token_texts(completion, token_text)
    top = _top_texts(completion, token_text)
    if kind == "text_completion":
        echo = completion.echo
        if echo is None:
            return {"index": index, "text": completion.text,
                    "logprobs": _text_logprobs(tokens, completion.logprobs, top),
                    "finish_reason": finish_reason}
        logprobs = None
        if completion.logprobs is not None and echo.logprobs is not None:
            assert tokens is not None and token_text is not None  # with the logprobs
            prompt_top = None if top is None else [
                [] if step is None else [(token_text(t), lp) for t, lp in step]
                for step in (echo.top_logprobs or [None] * len(echo.token_ids))]
            logprobs = _text_logprobs(
                [token_text(t) for t in echo.token_ids] + tokens,
                [*echo.logprobs, *completion.logprobs],
                None if top is None or prompt_top is None else prompt_top + top,
                first_is_none=True)
        return {"index": index, "text": echo.text + completion.text, "logprobs": logprobs,
                "finish_reason": finish_reason}
    message: dict[str, Any] = {"role": "assistant", "content": completion.text,
                               "refusal": None}
    if tool_calls and finish_reason in ("stop", "length"):
        # Cut at max_tokens, the calls it completed are kept; the finish says it was cut.
        message.update(content=None, tool_calls=tool_calls)
        finish_reason = "tool_calls" if finish_reason == "stop" else "length"
    return {"index": index, "message": message,
            "logprobs": _chat_logprobs(tokens, completion.logprobs, top),
            "finish_reason": finish_reason}


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The stored error of a failed job (the API's error object)."""
    return {"message": message, "type": type, "param": param, "code": code}


def param_of(message: str, known: tuple[str, ...]) -> str | None:
    """The request field a ValueError message names first, for the error's `param`.

    A field counts only as a whole word: `n` is in almost every message, and `max_tokens`
    inside `max_completion_tokens` is not that field.
    """
    positions = []
    for name in known:
        found = re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message)
        if found is not None:
            positions.append((found.start(), name))
    return min(positions)[1] if positions else None


def _token_texts(
    completion: Completion, token_text: Callable[[int], str] | None
) -> list[str] | None:
    if completion.logprobs is None:
        return None
    if token_text is None:
        raise ValueError("logprobs were returned but no way to render tokens was given")
    return [token_text(t) for t in completion.token_ids]


def _top_texts(completion: Completion, token_text: Callable[[int], str] | None
               ) -> list[list[tuple[str, float]]] | None:
    """Each position's alternatives as (token text, logprob), best first."""
    if completion.top_logprobs is None:
        return None
    if token_text is None:
        raise ValueError("top_logprobs were returned but no way to render tokens was given")
    return [[(token_text(t), lp) for t, lp in step] for step in completion.top_logprobs]


def _chat_logprobs(tokens: list[str] | None, logprobs: list[float] | None,
                   top: list[list[tuple[str, float]]] | None = None) -> Any:
    if tokens is None or logprobs is None:
        return None
    content = [
        {"token": t, "logprob": lp, "bytes": list(t.encode()),
         "top_logprobs": [] if top is None else [
             {"token": a, "logprob": a_lp, "bytes": list(a.encode())} for a, a_lp in top[i]]}
        for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=False))
    ]
    return {"content": content, "refusal": None}


def _text_logprobs(tokens: list[str] | None, logprobs: Sequence[float | None] | None,
                   top: list[list[tuple[str, float]]] | None = None, *,
                   first_is_none: bool = False) -> Any:
    """OpenAI's legacy logprobs object; with an echoed prompt (`first_is_none`) the first
    position has no logprob and no alternatives (null), as OpenAI's echo shows it."""
    if tokens is None or logprobs is None:
        return None
    offsets, position = [], 0
    for t in tokens:
        offsets.append(position)
        position += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        # One {token: logprob} per position; two alternatives that render alike share a key.
        "top_logprobs": None if top is None else [
            None if first_is_none and i == 0 else dict(step) for i, step in enumerate(top)],
        "text_offset": offsets,
    }
