"""Telling the model about a request's tools when its chat template does not.

Templates of tool-trained models (Qwen 2/3, Llama 3.1+, Mistral, Hermes) render `tools`
themselves; the engine passes them to `apply_chat_template`. A template that ignores them
(SmolLM2's, for one: the rendered prompt is the same with and without) would leave the
model unaware of them, so the engine adds them to the system message instead, in the
Hermes format most open models were tuned on: a `<tools>` list and calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (what the worker parses when
`tool_choice` is `auto`).
"""

from __future__ import annotations

import json
from typing import Any

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
