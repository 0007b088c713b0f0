"""What a prompt can be, and its token ids: text, token ids, or chat messages rendered by
the tokenizer's chat template (with tools, where the template takes them or in the system
message where it ignores them)."""

from __future__ import annotations

from typing import Any

from workers.engine.tokenizing import encode_ids
from workers.engine.tool_prompt import (
    has_tool_history,
    shows_tool_history,
    tool_history_as_hermes,
    with_arguments_as_objects,
    with_tools_in_system_message,
)

Prompt = str | list[int] | list[dict[str, Any]]


def tokenize_prompt(tokenizer: Any, vocab_size: int, prompt: Prompt,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None
                    ) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) for any accepted prompt form; `tokenizer` is None
    when the engine was built without one (token ids only). `template_kwargs`: variables
    for a chat template (chat messages only)."""
    if template_kwargs and not (isinstance(prompt, list) and prompt
                                and all(isinstance(m, dict) for m in prompt)):
        raise ValueError("chat_template_kwargs need a chat prompt (messages)")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("prompt: text needs a tokenizer; skip_tokenizer_init is set")
        return prompt, encode_ids(tokenizer, prompt)
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a non-empty string, token id list or chat messages")
    if all(isinstance(t, dict) for t in prompt):
        return render_chat(tokenizer, prompt, tools, template_kwargs)  # type: ignore[arg-type]
    if tools:
        raise ValueError("tools need a chat prompt (messages)")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError("prompt must be all token ids (int) or all chat messages (dict)")
    token_ids: list[int] = prompt  # type: ignore[assignment]
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside [0, {vocab_size}): {bad[:5]}")
    return None, list(token_ids)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """Apply the tokenizer's chat template, ending with the assistant's turn; tools and
    tool history in the template's own format where it has one, else in Hermes text.
    `template_kwargs` are the template's own variables (Qwen3's `enable_thinking`, as
    vLLM's `chat_template_kwargs`)."""
    kwargs = template_kwargs or {}
    if tokenizer is None:
        raise ValueError("prompt: chat messages need a tokenizer; skip_tokenizer_init is set")
    for message in messages:
        if not isinstance(message.get("role"), str) or (
                "content" not in message and not message.get("tool_calls")):
            raise ValueError("prompt: every chat message needs a 'role' and a 'content'")
    messages = with_arguments_as_objects(messages)
    try:
        if has_tool_history(messages):
            try:
                text = _render_native(tokenizer, messages, tools, kwargs)
            except Exception:  # noqa: BLE001 - jinja's own errors: no `tool` role in the template
                text = None
            if text is not None and not shows_tool_history(text, messages):
                text = None
        else:
            text = _render_native(tokenizer, messages, tools, kwargs)
        if text is None:  # the template cannot show the tools or the history: Hermes text
            hermes = tool_history_as_hermes(messages)
            text = _apply(tokenizer, with_tools_in_system_message(hermes, tools) if tools
                          else hermes, **kwargs)
    except Exception as e:  # noqa: BLE001 - no chat template, or the template's own refusal
        raise ValueError(f"prompt: cannot render chat messages: {e}") from e
    # The template already places special tokens such as BOS.
    return text, encode_ids(tokenizer, text, add_special_tokens=False)


def _render_native(tokenizer: Any, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str | None:
    """The template's own rendering; None when it ignores `tools` (the same text with and
    without them)."""
    text = _apply(tokenizer, messages, **kwargs)
    if not tools:
        return text
    with_tools = _apply(tokenizer, messages, tools=tools, **kwargs)
    return with_tools if with_tools != text else None


def _apply(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True, **kwargs))
