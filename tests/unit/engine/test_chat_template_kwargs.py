"""A request's `chat_template_kwargs` (vLLM's name): variables the model's chat template
reads, such as Qwen3's `enable_thinking`, rendered as Hugging Face renders them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.engine.test_engine import make_engine
from tests.unit.engine.tiny_models import byte_level_tokenizer, save_tiny_llama
from workers.engine import SamplingParams
from workers.engine.prompts import render_chat, tokenize_prompt

MESSAGES = [{"role": "user", "content": "Answer briefly."}]
NO_THINKING = {"enable_thinking": False}


def test_variables_reach_the_template_as_hugging_face_renders_them() -> None:
    """The tiny template closes an empty thinking block when `enable_thinking` is false,
    as Qwen3's does; without the variable it renders as before."""
    tokenizer = byte_level_tokenizer()
    plain, plain_ids = render_chat(tokenizer, MESSAGES)
    text, ids = render_chat(tokenizer, MESSAGES, template_kwargs=NO_THINKING)
    assert text == tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                 add_generation_prompt=True, **NO_THINKING)
    assert text == plain + "<think>\n\n</think>\n\n"
    assert ids[:len(plain_ids)] == plain_ids and len(ids) > len(plain_ids)
    # With tools (rendered in the system message where the template ignores them) too.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with_tools, _ = render_chat(tokenizer, MESSAGES, tools, NO_THINKING)
    assert with_tools.endswith("<|assistant|><think>\n\n</think>\n\n")


def test_variables_need_chat_messages() -> None:
    with pytest.raises(ValueError, match="chat_template_kwargs need a chat prompt"):
        tokenize_prompt(byte_level_tokenizer(), 300, "plain text", None, NO_THINKING)


def test_the_engine_renders_a_request_with_its_variables(tmp_path: Path) -> None:
    """Two requests of the same messages, one with the variable: its prompt is the other's
    and the closed block, and each runs."""
    save_tiny_llama(tmp_path / "m")
    engine = make_engine(tmp_path / "m")
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("plain", MESSAGES, params)
    engine.add_request("no-think", MESSAGES, params, chat_template_kwargs=NO_THINKING)
    prompts = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                prompts[output.request_id] = output.prompt_token_ids
                assert len(output.token_ids) == 2
    expected = render_chat(engine.tokenizer, MESSAGES, template_kwargs=NO_THINKING)[1]
    assert prompts["no-think"] == expected
    assert prompts["no-think"][:len(prompts["plain"])] == prompts["plain"]
    assert len(prompts["no-think"]) > len(prompts["plain"])
