"""A conversation that carries tool calls and their results renders for the model.

Three kinds of chat template: one that knows tools (renders `tools`, an assistant's
`tool_calls` with `tojson` and the `tool` role, as Qwen's and Hermes' do), one that knows
nothing of them (the tiny tokenizer's, like SmolLM2's), and one that refuses a role it
does not know (as Gemma's and Mistral's raise).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.unit.engine.tiny_models import byte_level_tokenizer
from workers.engine.prompts import render_chat

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "-3C"},
]
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|tool|>{{ m.content }}\n"
    "{% elif m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}"
    "<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('Conversation roles must be user, assistant or system') }}{% endif %}"
    "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tokenizer(template: str | None = None) -> Any:
    tok = byte_level_tokenizer()
    if template is not None:
        tok.chat_template = template
    return tok


def test_a_template_that_knows_tools_renders_calls_with_their_arguments_as_objects() -> None:
    """`arguments` arrive as JSON text (OpenAI's shape) and reach the template as objects:
    its `tojson` writes them once, not as a quoted string."""
    text, token_ids = render_chat(tokenizer(TOOL_TEMPLATE), CONVERSATION, TOOLS)
    assert '<call>get_weather {"city": "Paris"}</call>' in text
    assert '<call>get_weather {"city": "Oslo"}</call>' in text
    assert "<|tool|>22C\n<|tool|>-3C\n" in text and "<tool_response>" not in text
    assert text.startswith("<tools>") and text.endswith("<|assistant|>")
    assert token_ids


@pytest.mark.parametrize("template", [None, STRICT_TEMPLATE], ids=["ignores-tools", "strict"])
def test_a_template_without_tools_gets_the_history_as_hermes_text(template: str | None) -> None:
    """Calls become `<tool_call>` blocks of the assistant's turn; consecutive results one
    user turn of `<tool_response>` blocks; the tools join the system message."""
    text, _ = render_chat(tokenizer(template), CONVERSATION, TOOLS)
    paris = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    oslo = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
    calls = f"<tool_call>\n{paris}\n</tool_call>\n<tool_call>\n{oslo}\n</tool_call>"
    assert f"<|assistant|>{calls}\n" in text
    assert ("<|user|><tool_response>\n22C\n</tool_response>\n"
            "<tool_response>\n-3C\n</tool_response>\n<|assistant|>") in text
    assert "<|system|>You may call one or more functions" in text
    assert "<|tool|>" not in text


def test_history_without_tools_in_the_request_still_shows_the_calls() -> None:
    """A follow-up that no longer offers tools keeps what was called and answered."""
    text, _ = render_chat(tokenizer(), CONVERSATION)
    assert '"arguments": {"city": "Paris"}' in text and "22C" in text
    assert "You may call" not in text


def test_a_message_needs_content_unless_it_carries_calls() -> None:
    with pytest.raises(ValueError, match="'role' and a 'content'"):
        render_chat(tokenizer(), [{"role": "user"}])
    text, _ = render_chat(tokenizer(), [CONVERSATION[0],
                                        {k: v for k, v in CONVERSATION[1].items()
                                         if k != "content"}])
    assert "<tool_call>" in text


def test_a_template_that_refuses_plain_messages_is_a_value_error() -> None:
    refusing = "{{ raise_exception('no chat here') }}"
    with pytest.raises(ValueError, match="cannot render chat messages: no chat here"):
        render_chat(tokenizer(refusing), [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template", [TOOL_TEMPLATE, None], ids=["knows-tools", "hermes"])
def test_arguments_nested_past_any_bound_render_as_text(template: str | None) -> None:
    """A client's `arguments` text nested 100,000 deep: parsed, it would recurse to a
    RecursionError (a 500 and, on a batch line, a failed batch); it is rendered as text."""
    deep = "[" * 100_000 + "]" * 100_000
    conversation = [CONVERSATION[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": deep}}]}, CONVERSATION[2]]
    text, token_ids = render_chat(tokenizer(template), conversation, TOOLS)
    assert "[[[[" in text and "22C" in text and token_ids
