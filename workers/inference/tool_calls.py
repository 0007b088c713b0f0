"""The model's output → OpenAI's `tool_calls`, by the request's `tool_choice`.

- `required`: the grammar made the output a JSON list of `{"name", "arguments"}` objects;
- a named function: one such object;
- `auto`: the output is free text; calls the model wrote in the Hermes format
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what tool_prompt asks for
  and Qwen/Hermes templates use) or as the whole output in JSON are taken as calls when
  they name one of the tools; anything else is the message's content.
An output cut short (`length`) keeps the calls it completed (a small model asked for
`required` calls can repeat one call until `max_tokens`): a forced list's whole elements,
`auto`'s closed `<tool_call>` blocks; with none complete it is returned as content, as
it stands.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from core.structured_outputs import tool_mode

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_calls_of(body: dict[str, Any], text: str, *, is_cut: bool = False
                  ) -> list[dict[str, Any]] | None:
    """OpenAI tool call objects for this output, or None when it holds no call;
    `is_cut`: the output ended at `max_tokens` (only its complete calls count)."""
    mode, _ = tool_mode(body.get("tools"), body.get("tool_choice"))
    if mode == "none":
        return None
    names = {t["function"]["name"] for t in body.get("tools") or []}
    if not is_cut:
        calls = _parse(text, constrained=mode != "auto")
    elif mode == "required":
        calls = _whole_elements(text)
    elif mode == "auto":
        calls = _parse(text, constrained=False)  # only closed <tool_call> blocks parse
    else:
        calls = []  # a named call cut short is not whole
    if not calls or any(c.get("name") not in names for c in calls):
        return None
    return [
        {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {
                "name": call["name"],
                "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False),
            },
        }
        for call in calls
    ]


def _parse(text: str, *, constrained: bool) -> list[dict[str, Any]]:
    """Call objects in `text`: the whole text as JSON, or Hermes-tagged calls (auto)."""
    candidates = [text.strip()]
    if not constrained:
        tagged = _HERMES_CALL.findall(text)
        if tagged:
            candidates = tagged
    calls: list[dict[str, Any]] = []
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            return []
        for call in value if isinstance(value, list) else [value]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not (
                    isinstance(call.get("arguments", {}), dict)):
                return []
            calls.append(call)
    return calls


def _whole_elements(text: str) -> list[dict[str, Any]]:
    """The complete call objects at the start of a JSON list cut short."""
    decoder = json.JSONDecoder()
    at = text.find("[")
    if at < 0:
        return []
    calls: list[dict[str, Any]] = []
    at += 1
    while True:
        while at < len(text) and text[at] in " \t\n\r,":
            at += 1
        try:
            call, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return calls
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not (
                isinstance(call.get("arguments", {}), dict)):
            return []
        calls.append(call)
