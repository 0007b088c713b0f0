"""OpenAI's streaming chunks and the Server-Sent Events that carry them.

A streamed chat completion is a run of `chat.completion.chunk` objects: the first delta
holds the role (`{"role": "assistant", "content": ""}`), the next ones text, the last
one an empty delta with the `finish_reason`; with `stream_options.include_usage` every
chunk carries `"usage": null` and one more chunk follows with no choices and the usage.
A streamed text completion is the same run of `text_completion` objects with `text` in
place of a delta (and no role chunk). Each goes out as `data: <json>\\n\\n`, and the
stream ends with `data: [DONE]`. A failure after the stream began is an
`{"error": {...}}` event, which OpenAI's clients raise as an APIError.

Logprobs come whole, in one chunk per choice just before the finishes (`logprobs`): the
text streams as the engine hands it out, which holds back text that may become a stop
string or half a character, so a step's tokens and its text do not line up. A client
that joins the chunks' text and their `logprobs` gets exactly the result the request
gets without `stream`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from api.tool_call_stream import tool_call_deltas
from core.responses_api import response_text

DONE = b"data: [DONE]\n\n"
# An SSE comment: keeps proxies and clients from timing out a stream that waits in a queue.
KEEPALIVE = b": keepalive\n\n"


def sse(data: dict[str, Any]) -> bytes:
    """One `data:` event (JSON on one line, as SSE requires)."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


def named_sse(event: str, data: dict[str, Any], event_id: int | None = None) -> bytes:
    """One event with a name (`event: <name>`), as `GET /v1/jobs/{id}/events` sends; with
    an `id:` line when `event_id` is given (what a client's `Last-Event-ID` sends back)."""
    head = b"" if event_id is None else b"id: %d\n" % event_id
    return head + b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


@dataclass(frozen=True, slots=True)
class ChunkMaker:
    """Builds the chunks of one streamed completion (module docstring)."""

    kind: str  # "chat.completion" or "text_completion"
    job_id: str
    model: str
    created: int
    include_usage: bool = False

    @property
    def is_chat(self) -> bool:
        """Whether the chunks are `chat.completion.chunk`s."""
        return self.kind == "chat.completion"

    def first(self, index: int = 0, *, content: str | None = "") -> dict[str, Any] | None:
        """The chunk sent before any text of choice `index`: the role, for a chat; none
        for a text one. `content` None: an answer that will be tool calls, as OpenAI
        opens one."""
        if not self.is_chat:
            return None
        return self._chunk({"role": "assistant", "content": content}, finish_reason=None,
                           index=index)

    def text(self, text: str, index: int = 0, logprobs: Any = None) -> dict[str, Any]:
        """A chunk that adds `text` to choice `index` (and `logprobs`, when given)."""
        return self._chunk({"content": text} if self.is_chat else text, finish_reason=None,
                           index=index, logprobs=logprobs)

    def calls(self, calls: list[dict[str, Any]], index: int = 0,
              logprobs: Any = None) -> dict[str, Any]:
        """A chunk that carries choice `index`'s tool calls whole (see tool_call_stream)."""
        return self._chunk(tool_call_deltas(calls), finish_reason=None, index=index,
                           logprobs=logprobs)

    def logprobs(self, logprobs: Any, index: int = 0) -> dict[str, Any]:
        """A chunk that adds no text, only choice `index`'s logprobs (module docstring)."""
        return self._chunk({} if self.is_chat else "", finish_reason=None, index=index,
                           logprobs=logprobs)

    def finish(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        """The last chunk of choice `index`: no new text, the finish reason."""
        return self._chunk({} if self.is_chat else "", finish_reason=finish_reason, index=index)

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The chunk after the last one, with `include_usage`: no choices, the usage."""
        chunk = self._envelope()
        chunk["choices"] = []
        chunk["usage"] = usage
        return chunk

    def _chunk(self, delta: dict[str, Any] | str, *, finish_reason: str | None,
               index: int = 0, logprobs: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if isinstance(delta, dict):
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        chunk = self._envelope()
        chunk["choices"] = [choice]
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _envelope(self) -> dict[str, Any]:
        if self.is_chat:
            return {"id": f"chatcmpl-{self.job_id}", "object": "chat.completion.chunk",
                    "created": self.created, "model": self.model,
                    "system_fingerprint": None}
        return {"id": f"cmpl-{self.job_id}", "object": "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None}


def result_text(result: dict[str, Any], index: int = 0) -> str:
    """The text of choice `index` of a stored `chat.completion` or `text_completion` result
    (of a `response`, its output text)."""
    if result.get("object") == "response":
        return response_text(result)
    choices = result.get("choices") or [{}]
    choice = choices[index] if index < len(choices) else {}
    if "message" in choice:
        return str(choice["message"].get("content") or "")
    return str(choice.get("text") or "")


def result_calls(result: dict[str, Any], index: int = 0) -> list[dict[str, Any]]:
    """The tool calls of choice `index` of a stored chat result ([] for none)."""
    choices = result.get("choices") or [{}]
    choice = choices[index] if index < len(choices) else {}
    return list((choice.get("message") or {}).get("tool_calls") or [])


def error_event(error: dict[str, Any]) -> bytes:
    """The event that ends a stream that failed: OpenAI's `{"error": {...}}`."""
    return sse({"error": {"message": error.get("message") or "The request failed.",
                          "type": error.get("type") or "server_error",
                          "param": error.get("param"), "code": error.get("code")}})
