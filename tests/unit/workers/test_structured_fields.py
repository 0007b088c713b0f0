"""Job bodies with structured-output fields → SamplingParams, and outputs → tool_calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.structured_outputs import tool_call_schema
from workers.inference.results import Completion, build_result
from workers.inference.sampling import chat_tools, sampling_params_from_body
from workers.inference.tool_calls import tool_calls_of

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def test_fields_reach_sampling_params() -> None:
    """Penalties, biases (keys as ints) and the schema of response_format."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = sampling_params_from_body("chat.completion", CHAT | {
        "presence_penalty": 0.5, "frequency_penalty": -0.25, "logit_bias": {"7": -100},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n",
                                                                   "schema": schema}}})
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert params.logit_bias == {7: -100.0}
    assert json.loads(params.json_schema or "") == schema
    plain = sampling_params_from_body("chat.completion", CHAT | {
        "response_format": {"type": "text"}})
    assert plain.json_schema is None
    as_object = sampling_params_from_body("chat.completion", CHAT | {
        "response_format": {"type": "json_object"}})
    assert json.loads(as_object.json_schema or "") == {"type": "object"}


def test_forced_tool_choice_becomes_the_schema_and_tools_reach_the_prompt() -> None:
    """required: a list of calls (one at most without parallel calls); named: one call."""
    required = sampling_params_from_body("chat.completion", CHAT | {
        "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(required.json_schema or "")
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    named = tool_call_schema(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert named is not None and named["properties"]["name"] == {"const": "get_time"}
    auto = sampling_params_from_body("chat.completion", CHAT | {"tools": TOOLS})
    assert auto.json_schema is None  # auto leaves the text free...
    assert json.loads(auto.structural_tag or "")["format"]["triggers"] == ["<tool_call>"]
    assert chat_tools(CHAT | {"tools": TOOLS}) == TOOLS
    assert chat_tools(CHAT | {"tools": TOOLS, "tool_choice": "none"}) is None
    with pytest.raises(ValueError, match="response_format and a forced tool_choice"):
        sampling_params_from_body("chat.completion", CHAT | {
            "tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}})


@pytest.mark.parametrize(("choice", "text", "names"), [
    ("required", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', ["get_weather"]),
    ({"type": "function", "function": {"name": "get_time"}},
     '{"name": "get_time", "arguments": {}}', ["get_time"]),
    ("auto", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
             '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     ["get_weather", "get_time"]),
    ("auto", '{"name": "get_time", "arguments": {}}', ["get_time"]),
    ("auto", "It is sunny in Rome.", None),
    ("auto", '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', None),
    ("auto", "<tool_call>{not json</tool_call>", None),
    ("none", '{"name": "get_time", "arguments": {}}', None),
])
def test_outputs_become_openai_tool_calls(choice: Any, text: str, names: list[str] | None
                                          ) -> None:
    """Calls parse by mode; arguments are JSON strings; unknown tools are not calls."""
    calls = tool_calls_of({"tools": TOOLS, "tool_choice": choice}, text)
    if names is None:
        assert calls is None
        return
    assert calls is not None and [c["function"]["name"] for c in calls] == names
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_result_carries_tool_calls_finished_or_cut() -> None:
    """finish_reason tool_calls and content null; cut short, the calls it completed with
    finish_reason length; none completed, the text stays content."""
    calls = tool_calls_of({"tools": TOOLS, "tool_choice": "required"},
                          '[{"name": "get_time", "arguments": {}}]')
    completion = Completion(text='[{"name": "get_time", "arguments": {}}]', token_ids=[1, 2],
                            finish_reason="stop", num_prompt_tokens=3, num_cached_tokens=0)
    result = build_result("chat.completion", job_id="j", model="m", completion=completion,
                          created=0, tool_calls=calls)
    choice = result["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"] == calls
    completion.finish_reason = "length"
    cut = build_result("chat.completion", job_id="j", model="m", completion=completion,
                       created=0, tool_calls=calls)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"] == calls
    nothing = build_result("chat.completion", job_id="j", model="m", completion=completion,
                           created=0, tool_calls=None)["choices"][0]
    assert nothing["finish_reason"] == "length" and "tool_calls" not in nothing["message"]
    assert nothing["message"]["content"] == completion.text


REPEATED = '{"name": "get_time", "arguments": {}}'


@pytest.mark.parametrize(("choice", "text", "names"), [
    ("required", f"[{REPEATED}, {REPEATED}, {REPEATED[:20]}", ["get_time", "get_time"]),
    ("required", f"[ {REPEATED} ,{REPEATED}", ["get_time", "get_time"]),
    ("required", REPEATED[:20], None),
    ("required", '[{"name": "nope", "arguments": {}}, {"na', None),
    ("required", '[["get_time"], {"na', None),
    ({"type": "function", "function": {"name": "get_time"}}, REPEATED[:-1], None),
    ("auto", f"<tool_call>{REPEATED}</tool_call> and <tool_call>{REPEATED[:9]}", ["get_time"]),
])  # fmt: skip
def test_an_output_cut_short_keeps_the_calls_it_completed(
        choice: Any, text: str, names: list[str] | None) -> None:
    """A model that repeats its call until max_tokens still answers with calls."""
    calls = tool_calls_of({"tools": TOOLS, "tool_choice": choice}, text, is_cut=True)
    assert (None if calls is None else [c["function"]["name"] for c in calls]) == names


def _tag_matcher(body: dict[str, Any]) -> Any:
    from tests.unit.engine.tiny_models import byte_level_tokenizer
    from workers.engine.grammar import GrammarCompiler

    tokenizer = byte_level_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    params = sampling_params_from_body("chat.completion", CHAT | body)
    assert params.structural_tag is not None
    return compiler.new_tag_state(params.structural_tag).matcher


@pytest.mark.parametrize(("text", "takes"), [
    ("It is sunny.", True),
    ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
     " Done.", True),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', True),
    ('<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": 7}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', False),
    ("<tool_call>I changed my mind", False),
])
def test_auto_tools_constrain_a_call_from_its_trigger_on(text: str, takes: bool) -> None:
    """`auto`: free text is free; once `<tool_call>` is written, only a call of one of the
    tools with arguments its schema accepts can follow."""
    assert _tag_matcher({"tools": TOOLS}).accept_string(text) is takes


def test_auto_tools_without_parallel_calls_end_after_the_first() -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    matcher = _tag_matcher({"tools": TOOLS, "parallel_tool_calls": False})
    assert matcher.accept_string(call)
    assert not matcher.accept_string(" then " + call)
    assert _tag_matcher({"tools": TOOLS}).accept_string(call + " then " + call)


def test_auto_tools_beside_a_response_format_follow_the_format() -> None:
    params = sampling_params_from_body("chat.completion", CHAT | {
        "tools": TOOLS, "response_format": {"type": "json_object"}})
    assert params.structural_tag is None and params.json_schema is not None


def test_auto_tools_whose_parameters_cannot_be_enforced_are_refused() -> None:
    from core.structured_outputs import StructuredOutputError, check_output_schema

    broken = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]
    with pytest.raises(StructuredOutputError, match="missing") as refused:
        check_output_schema({"tools": broken})
    assert refused.value.param == "tools"
    check_output_schema({"tools": broken, "tool_choice": "none"})  # nothing to enforce
