"""A streamed chat completion that may call tools: its calls as `delta.tool_calls`.

The worker publishes the model's raw text. Where that text is a call (a forced
`tool_choice`: all of it; `auto`: from the model's `<tool_call>` on), relaying it as
`content` would hand the client the call's JSON as prose. So the text of choice 0 goes out
only up to the trigger (a tail that could be the trigger's beginning is held until the
next delta says), and once the job ends the stored result decides: its `tool_calls` go
out as OpenAI streams them (one `delta.tool_calls` entry per call, with its index, id,
type, name and arguments), or, when the output held no call after all (cut by
`max_tokens`, or not a call of these tools), the rest of its text as content.
"""

from __future__ import annotations

from typing import Any

from core.structured_outputs import TOOL_CALL_TRIGGER, tool_mode


class ToolTextGate:
    """What of choice 0's streamed text may go out as content (module docstring)."""

    def __init__(self, tools: object, tool_choice: object) -> None:
        mode, _ = tool_mode(tools, tool_choice)
        self.is_open = mode in ("none", "auto")  # forced calls: no text is content
        self.watches_trigger = mode == "auto"
        self.sent = ""
        self._held = ""

    def text(self, delta: str) -> str:
        """The part of `delta` to send as content now."""
        if not self.is_open:
            return ""
        if not self.watches_trigger:
            self.sent += delta
            return delta
        pending = self._held + delta
        at = pending.find(TOOL_CALL_TRIGGER)
        if at >= 0:
            self.is_open, self._held = False, ""
            out = pending[:at]
        else:
            keep = _trigger_prefix_at_end(pending)
            self._held = pending[len(pending) - keep:]
            out = pending[:len(pending) - keep]
        self.sent += out
        return out

    def rest(self, message: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, calls to send) once the job's result `message` is in."""
        calls = message.get("tool_calls") or []
        if calls:
            return "", calls
        content = str(message.get("content") or "")
        # Text relayed but not in the result (a job run again) cannot be taken back.
        return (content[len(self.sent):] if content.startswith(self.sent) else ""), []


def _trigger_prefix_at_end(text: str) -> int:
    """Length of the longest end of `text` that begins the trigger (held back)."""
    for n in range(min(len(text), len(TOOL_CALL_TRIGGER) - 1), 0, -1):
        if TOOL_CALL_TRIGGER.startswith(text[-n:]):
            return n
    return 0


def tool_call_deltas(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """`delta` of the chunk that carries these calls whole, in OpenAI's streamed shape."""
    return {"tool_calls": [
        {"index": i, "id": call["id"], "type": call.get("type", "function"),
         "function": {"name": call["function"]["name"],
                      "arguments": call["function"]["arguments"]}}
        for i, call in enumerate(calls)]}
