"""The typed Server-Sent Events of a streamed `/v1/responses` call, as OpenAI sends them.

Each event goes out as `event: <type>` with a JSON `data:` line that repeats the `type`
and carries a `sequence_number` counting up from 0 over the whole stream. In order:

- `response.created`, then `response.in_progress`: the response with no output yet;
- when text begins, `response.output_item.added` (the assistant message, empty) and
  `response.content_part.added` (an empty `output_text` part);
- `response.output_text.delta` for each piece of text as the engine makes it;
- at the end, `response.output_text.done` (the whole text), `response.content_part.done`,
  `response.output_item.done` (the message as stored), and last `response.completed`
  with the stored response, or `response.incomplete` when `max_output_tokens` cut it.

A job that failed ends the stream with `response.failed` (the response, status `failed`,
with its error); a stream that ends any other way (the job was cancelled, or ran out of
time) ends with an `error` event. Unlike chat streams there is no `data: [DONE]`. The
single output item is always at `output_index` 0 and its text part at `content_index` 0.
"""

from __future__ import annotations

from typing import Any

from api.stream_chunks import named_sse
from core.responses_api import response_text


class ResponseEvents:
    """Builds the events of one streamed response, numbering them (module docstring)."""

    def __init__(self, *, job_id: str, shell: dict[str, Any]) -> None:
        self.item_id = f"msg_{job_id}"
        self.shell = shell  # the response before output (core.responses_api.response_shell)
        self.num_events = 0
        self.has_output = False

    def opening(self) -> list[bytes]:
        """`response.created` and `response.in_progress`, before anything else."""
        return [self._event("response.created", response=self.shell),
                self._event("response.in_progress", response=self.shell)]

    def text(self, delta: str) -> list[bytes]:
        """The events that add `delta` to the text (opening the message if it is the first)."""
        return [*self._output_begins(), self._event(
            "response.output_text.delta", item_id=self.item_id, output_index=0,
            content_index=0, delta=delta, logprobs=[])]

    def ending(self, response: dict[str, Any]) -> list[bytes]:
        """The events after the last text, for the stored (finished) `response`."""
        text = response_text(response)
        items = response.get("output") or []
        item = items[0] if items else {"type": "message", "id": self.item_id,
                                       "status": response.get("status"),
                                       "role": "assistant", "content": []}
        part = {"type": "output_text", "text": text, "annotations": []}
        last = "response.incomplete" if response.get("status") == "incomplete" \
            else "response.completed"
        return [
            *self._output_begins(),
            self._event("response.output_text.done", item_id=self.item_id, output_index=0,
                        content_index=0, text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=self.item_id, output_index=0,
                        content_index=0, part=part),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(last, response=response),
        ]

    def failed(self, error: dict[str, Any]) -> list[bytes]:
        """`response.failed`: the job ended with `error` (the job's error object)."""
        # OpenAI's failure codes are a closed set: a request the worker could not run is
        # an invalid prompt, anything else a server error; the job's own code goes in the
        # message.
        code = "invalid_prompt" if error.get("type") == "invalid_request_error" \
            else "server_error"
        message = error.get("message") or "The response failed."
        if error.get("code"):
            message = f"{message} ({error['code']})"
        failure = {"code": code, "message": message}
        return [self._event("response.failed",
                            response={**self.shell, "status": "failed", "error": failure})]

    def error(self, error: dict[str, Any]) -> list[bytes]:
        """An `error` event: the stream ends without the response finishing."""
        return [self._event("error", code=error.get("code"),
                            message=error.get("message") or "The request failed.",
                            param=error.get("param"))]

    def _output_begins(self) -> list[bytes]:
        """The message and its text part, announced once before their first text."""
        if self.has_output:
            return []
        self.has_output = True
        item = {"type": "message", "id": self.item_id, "status": "in_progress",
                "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=self.item_id,
                            output_index=0, content_index=0, part=part)]

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return named_sse(kind, data)
