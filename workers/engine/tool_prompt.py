"""Telling the model about a request's tools when its chat template does not.

Templates of tool-trained models (Qwen 2/3, Llama 3.1+, Mistral, Hermes) render `tools`
themselves; the engine passes them to `apply_chat_template`. A template that ignores them
(SmolLM2's, for one: the rendered prompt is the same with and without) would leave the
model unaware of them, so the engine adds them to the system message instead, in the
Hermes format most open models were tuned on: a `<tools>` list and calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (what the worker parses when
`tool_choice` is `auto`).

A conversation that carries tool history (an assistant message's `tool_calls`, then
`tool` messages with their results) goes to a tool-trained template as it is, each call's
`arguments` JSON string read into an object first (templates write them with `tojson`, as
vLLM passes them). Where the template cannot render that history (it drops the calls, or
refuses the `tool` role), the history is written in the same Hermes format instead: calls
as `<tool_call>` blocks in the assistant's text, results as `<tool_response>` blocks in a
user turn (consecutive results in one turn, as Qwen's templates group them).
"""

from __future__ import annotations

import json
from typing import Any

from core.json_bounds import json_bounds_error

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions "
    "you can call are listed within <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "For each call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)


def with_tools_in_system_message(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`messages` with the tools described in the (first) system message."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    preamble = TOOLS_PREAMBLE.format(tools=listing)
    if messages and messages[0].get("role") in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{preamble}"
        return [first, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def with_arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each tool call's `arguments` JSON string parsed (when it is an
    object), as chat templates expect; messages without calls are returned as they are."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_call_with_object(c) for c in calls]}
        out.append(message)
    return out


def _call_with_object(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    text = function["arguments"]
    # Arguments nested deeper than a request body may be stay text: parsing them would
    # recurse to a RecursionError, and the template's `tojson` again.
    if json_bounds_error(text) is not None:
        return call
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def has_tool_history(messages: list[dict[str, Any]]) -> bool:
    """Whether any message is a tool call or a tool's result."""
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def shows_tool_history(text: str, messages: list[dict[str, Any]]) -> bool:
    """Whether a rendered prompt kept every call's name and every result."""
    for message in messages:
        for call in message.get("tool_calls") or []:
            if str((call.get("function") or {}).get("name", "")) not in text:
                return False
        if message.get("role") == "tool" and str(message.get("content") or "") not in text:
            return False
    return True


def tool_history_as_hermes(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with calls and results written as Hermes text in plain turns."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
            continue
        plain = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        calls = message.get("tool_calls")
        if calls:
            blocks = [_hermes_call(call) for call in calls]
            plain["content"] = "\n".join([message.get("content") or "", *blocks]).strip()
        out.append(plain)
    return [{k: v for k, v in m.items() if k != "_results"} for m in out]


def _hermes_call(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments", {})}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"
