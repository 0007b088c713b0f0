"""A streamed job's request to an engine server, asked with `stream`: its SSE chunks read
as they come into the text so far, and at the end into the answer a request without
`stream` would have had, so that the job's result is built the same either way.

Streamed: a request of one choice without tools or logprobs, whose text is all a stream
client reads. The others are asked whole (their followers get the text when it ends):
tool calls and logprobs come as fragments to be joined, and `n` choices interleave.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def is_streamable(payload: dict[str, Any]) -> bool:
    """Whether a request to a server may be asked with `stream` (see the module docstring)."""
    logprobs = payload.get("logprobs")  # a text request's 0 asks for them too
    return (payload.get("n") in (None, 1) and not payload.get("tools")
            and (logprobs is None or logprobs is False))


def streamed(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` asked as a stream whose last chunk carries the usage (OpenAI's and vLLM's
    `stream_options.include_usage`)."""
    return {**payload, "stream": True, "stream_options": {"include_usage": True}}


class StreamError(ValueError):
    """The server ended its stream with an error, or sent what is not a stream chunk."""


@dataclass(slots=True)
class StreamAssembler:
    """The chunks of one streamed answer, joined; `is_chat`: chat's `delta.content`,
    else a text completion's `text`."""

    is_chat: bool
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    refusal: str = ""
    is_done: bool = field(default=False)

    def feed_line(self, line: str) -> str:
        """Take one line of the SSE body; the text it adds (often ""). StreamError for an
        error event or a chunk that cannot be read."""
        if not line.startswith("data:"):
            return ""  # blank separators, comments (keep-alives), `event:` names
        data = line[5:].strip()
        if data == "[DONE]":
            self.is_done = True
            return ""
        try:
            chunk = json.loads(data)
        except ValueError as e:
            raise StreamError(f"the engine server sent a stream chunk that is not JSON: "
                              f"{data[:200]!r}") from e
        if not isinstance(chunk, dict):
            raise StreamError(f"the engine server sent a stream chunk that is not an "
                              f"object: {data[:200]!r}")
        if "error" in chunk or chunk.get("object") == "error":  # vLLM's, new and old
            error = chunk.get("error", chunk)
            message = error.get("message") if isinstance(error, dict) else error
            raise StreamError(f"the engine server ended the stream with an error: {message}")
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise StreamError(f"the engine server sent a stream chunk whose choices are not a "
                              f"list: {data[:200]!r}")
        added = ""
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if self.is_chat:
                delta = choice.get("delta") or {}
                if not isinstance(delta, dict):
                    raise StreamError(f"the engine server sent a chunk whose delta is not an "
                                      f"object: {data[:200]!r}")
                added += _text(delta.get("content"), data)
                self.refusal += _text(delta.get("refusal"), data)
            else:
                added += _text(choice.get("text"), data)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        self.text += added
        return added

    @property
    def is_complete(self) -> bool:
        """Whether the answer came to its end: a finish reason (`[DONE]` alone is not one:
        a server's error may come as text it did not mark)."""
        return self.finish_reason is not None

    def answer(self) -> dict[str, Any]:
        """The answer as the server would have sent it whole."""
        finish_reason = self.finish_reason or "stop"
        if self.is_chat:
            message = {"role": "assistant", "content": self.text,
                       "refusal": self.refusal or None}
            choice: dict[str, Any] = {"index": 0, "message": message,
                                      "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": finish_reason,
                      "logprobs": None}
        answer: dict[str, Any] = {"choices": [choice]}
        if self.usage is not None:
            answer["usage"] = self.usage
        return answer


def _text(value: object, data: str) -> str:
    """A chunk's text field: a string, or absent; StreamError for anything else."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise StreamError(f"the engine server sent a chunk whose text is not a string: "
                          f"{data[:200]!r}")
    return value
