"""A job ↔ an OpenAI-compatible engine server: the HTTP request it becomes, the result it
gets back in our job shape, and the message of a refusal.

The request carries the job's own fields (as the API normalised them: `inference_body`),
not the engine's SamplingParams: a chat job without `max_tokens` must leave the limit to
the server (the rest of its context), where our engine fills in its own context length.
Only fields the job set are sent, so a server that knows no `top_k` never sees one unless
a job asked for it (and then the server's 400 says so).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from core.messages import JobMessage
from core.responses_api import response_object
from core.topics import Priority
from workers.engine.outputs import RequestMetrics

# Job fields passed through under the same name (vLLM's names for its extras).
# Structured output and tools go as the client sent them: a server that cannot honour one
# refuses it (the job fails with its message) rather than answering free text unasked.
PASSED_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
                 "user", "presence_penalty", "frequency_penalty", "n", "logit_bias",
                 "response_format", "tools", "tool_choice", "parallel_tool_calls",
                 "chat_template_kwargs", "echo")
# Finish reasons a server may give that our results carry as they are.
FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter"}


def request_of(
    message: JobMessage, *, model: str, send_priority: bool
) -> tuple[str, dict[str, Any]]:
    """(path under the server's /v1, JSON body) for `message`; ValueError for a job kind
    an engine server cannot run here."""
    body = message.body
    payload: dict[str, Any] = {"model": model}
    if message.kind in ("chat.completion", "response"):  # a response runs as its chat body
        path = "/chat/completions"
        payload["messages"] = body["messages"]
        if body.get("logprobs"):
            payload["logprobs"] = True
            if body.get("top_logprobs"):
                payload["top_logprobs"] = body["top_logprobs"]
    elif message.kind == "text_completion":
        path = "/completions"
        payload["prompt"] = body["prompt"]
        logprobs = body.get("logprobs")
        if logprobs is not None and logprobs is not False:
            # A count of alternatives per position (0: the sampled token's only).
            payload["logprobs"] = body.get("top_logprobs") or (
                0 if logprobs is True else logprobs)
    else:
        raise ValueError(f"a worker in front of an engine server runs chat and text "
                         f"completions and responses, not {message.kind!r} jobs")
    payload.update((name, body[name]) for name in PASSED_FIELDS if body.get(name) is not None)
    if send_priority:
        payload["priority"] = Priority(message.priority).rank  # vLLM: lower runs first
    return path, payload


@dataclass(slots=True)
class RemoteOutput:
    """What an engine server answered for one request (a 200 with its completion)."""

    request_id: str
    response: dict[str, Any]
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))

    @property
    def finish_reason(self) -> str | None:
        """The server's finish reason of the one choice."""
        choices = self.response.get("choices") or [{}]
        reason = choices[0].get("finish_reason")
        return str(reason) if reason is not None else None

    @property
    def text(self) -> str:
        """The text of the one choice (a chat message's content, or a completion's text)."""
        choice = (self.response.get("choices") or [{}])[0]
        message = choice.get("message")
        return str((message.get("content") if isinstance(message, dict)
                    else choice.get("text")) or "")

    @property
    def num_output_tokens(self) -> int:
        """Completion tokens, as the server counted them (0 when it did not say)."""
        usage = self.response.get("usage") or {}
        return int(usage.get("completion_tokens") or 0)


def check_response(response: object) -> dict[str, Any]:
    """The response object if it holds one choice with text; ValueError saying what is
    missing otherwise."""
    if not isinstance(response, dict):
        raise ValueError(f"the engine server answered {type(response).__name__}, not a "
                         "completion object")
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("the engine server's answer has no choices")
    return response


def build_remote_result(
    message: JobMessage, output: RemoteOutput, *, created: int, system_fingerprint: str | None
) -> dict[str, Any]:
    """The job's result in the shape our engine's results have (our ids, the served
    model's name), with the server's text, logprobs, finish_reason and usage; a
    `response` job's is its chat result reshaped as the Responses API's object."""
    is_chat = message.kind in ("chat.completion", "response")
    choices = [_shaped_choice("chat.completion" if is_chat else message.kind, index, choice)
               for index, choice in enumerate(output.response["choices"])]
    object_name, id_prefix = (("chat.completion", "chatcmpl") if is_chat
                              else ("text_completion", "cmpl"))
    result = {
        "id": f"{id_prefix}-{message.job_id}",
        "object": object_name,
        "created": created,
        "model": message.model,
        "choices": choices,
        "usage": _usage(output.response.get("usage")),
        "system_fingerprint": system_fingerprint,
    }
    if message.kind == "response":
        return response_object(result, job_id=message.job_id, body=message.body)
    return result


def _shaped_choice(kind: str, index: int, choice: dict[str, Any]) -> dict[str, Any]:
    """One of the server's choices as our results have it."""
    reason = choice.get("finish_reason") or "stop"
    finish_reason = reason if reason in FINISH_REASONS else "stop"
    if kind != "chat.completion":
        return {"index": index, "text": choice.get("text") or "",
                "logprobs": choice.get("logprobs"), "finish_reason": finish_reason}
    sent = choice.get("message") or {}
    shaped: dict[str, Any] = {
        "index": index,
        "message": {"role": "assistant", "content": sent.get("content") or "",
                    "refusal": sent.get("refusal")},
        "logprobs": choice.get("logprobs"),
        "finish_reason": finish_reason,
    }
    if sent.get("tool_calls"):
        shaped["message"]["tool_calls"] = sent["tool_calls"]
    return shaped


def _usage(usage: object) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    shaped: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        shaped["prompt_tokens_details"] = {"cached_tokens": int(details["cached_tokens"])}
    return shaped


def error_message(status_code: int, payload: object, text: str) -> str:
    """The server's own words for a refused request: OpenAI's `error.message`, FastAPI's
    `detail`, or the body as text."""
    said: object = None
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            said = error.get("message")
        elif isinstance(error, str):
            said = error
        if said is None:
            said = payload.get("message") or payload.get("detail")
    if said is None or said == "":
        said = text.strip()[:2000] or "no message"
    return f"the engine server refused the request ({status_code}): {said}"
