"""Grammar-constrained decoding through LLMEngine on a random-weight Llama (CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.unit.engine.test_engine import make_llm, model_dir  # noqa: F401 - fixture
from workers.engine import SamplingParams

# A finite language: every path through it ends within a few tokens, so a random model
# under the grammar must reach the end and stop.
FINITE = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["colour", "ok", "tags"],
    "additionalProperties": False,
}


def params(schema: dict[str, object], **kw: object) -> SamplingParams:
    """Constrained parameters; max_tokens far above what the finite language needs."""
    return SamplingParams(json_schema=json.dumps(schema), **{"max_tokens": 120, **kw})  # type: ignore[arg-type]


def test_constrained_outputs_parse_validate_and_stop(model_dir: Path) -> None:  # noqa: F811
    """Greedy and sampled rows, beside an unconstrained row, all end in a valid document."""
    llm = make_llm(model_dir)
    prompts = ["hello world", "the quick brown fox", "User: what is", "0123"]
    batch = [params(FINITE, temperature=0), params(FINITE, temperature=1.0, seed=3),
             params(FINITE, temperature=0.8, top_p=0.9, seed=4),
             SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    outputs = llm.generate(prompts, batch)
    for out in outputs[:3]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), FINITE)
    assert outputs[3].finish_reason == "length"
    assert len(outputs[3].token_ids) == 8


def test_json_object_and_length_mid_object(model_dir: Path) -> None:  # noqa: F811
    """max_tokens reached inside the object: finish_reason length, the text a prefix."""
    llm = make_llm(model_dir)
    [out] = llm.generate(["hello"], [params(FINITE, temperature=0, max_tokens=3)])
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)
    [full] = llm.generate(["hello"], [params(FINITE, temperature=0)])
    assert full.text.startswith(out.text)


def test_eos_only_where_the_grammar_accepts(model_dir: Path) -> None:  # noqa: F811
    """A strong bias towards EOS cannot end the output before the document is whole."""
    llm = make_llm(model_dir)
    eos = min(llm.engine.runner.eos_token_ids)
    [out] = llm.generate(["hello"], [params(FINITE, temperature=0, logit_bias={eos: 100.0})])
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), FINITE)


def test_uncompilable_schema_is_refused_for_that_request(model_dir: Path) -> None:  # noqa: F811
    """A schema xgrammar cannot compile is a ValueError naming response_format."""
    llm = make_llm(model_dir)
    with pytest.raises(ValueError, match="response_format"):
        llm.generate(["hello"], [SamplingParams(json_schema='{"type": "nonsense"}')])
    with pytest.raises(ValueError, match="response_format"):
        llm.generate(["hello"], [SamplingParams(json_schema="{not json")])


def test_a_structural_tag_leaves_text_free_and_constrains_after_its_trigger(
    model_dir: Path,  # noqa: F811
) -> None:
    """The trigger is the text the model writes first anyway; from it on the output must
    be the tag: a FINITE document, then its end string, then (stop_after_first) the end."""
    llm = make_llm(model_dir)
    [free] = llm.generate(["hello"], [SamplingParams(temperature=0, max_tokens=1)])
    trigger = free.text
    assert trigger.strip(), f"the first token {free.token_ids} has no visible text"
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [trigger],
        "tags": [{"type": "tag", "begin": trigger,
                  "content": {"type": "json_schema", "json_schema": FINITE,
                              "max_whitespace_cnt": 1},
                  "end": "!"}],
        "at_least_one": False, "stop_after_first": True}}
    [out] = llm.generate(["hello"], [SamplingParams(
        temperature=0, max_tokens=120, structural_tag=json.dumps(tag))])
    assert out.finish_reason == "stop", repr((trigger, out.text))
    assert out.text.startswith(trigger) and out.text.endswith("!"), out.text
    jsonschema.validate(json.loads(out.text[len(trigger):-1]), FINITE)
    [unconstrained] = llm.generate(["hello"], [SamplingParams(temperature=0, max_tokens=20)])
    assert unconstrained.text != out.text  # the tag changed what the model wrote


def test_forced_calls_of_tools_with_definitions_follow_each_tools_own(
    model_dir: Path,  # noqa: F811
) -> None:
    """pydantic-style parameters ($defs, $ref) with tool_choice required and named: two
    tools whose `Address` definitions share a name and differ; every call's arguments
    validate against that tool's own parameters."""
    from workers.inference.sampling import sampling_params_from_body
    from workers.inference.tool_calls import tool_calls_of

    def address(prop: str, values: list[Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {prop: {"enum": values}}, "required": [prop],
                "additionalProperties": False}

    def tool(name: str, definition: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "$defs": {"Address": definition},
            "properties": {"to": {"$ref": "#/$defs/Address"},
                           "cc": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]}},
            "required": ["to", "cc"], "additionalProperties": False}}}

    tools = [tool("send", address("city", ["Oslo", "Rome"])), tool("ship", address("port", [7]))]
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    llm = make_llm(model_dir)
    bodies: list[dict[str, Any]] = [{"tool_choice": "required", "parallel_tool_calls": False},
              {"tool_choice": {"type": "function", "function": {"name": "ship"}}},
              {"tool_choice": "required", "parallel_tool_calls": False}]
    params = [sampling_params_from_body("chat.completion", {
        "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 120,
        "temperature": temperature, "seed": 5, **body})
        for body, temperature in zip(bodies, (0, 0, 1.0), strict=True)]
    outputs = llm.generate(["hello", "the quick brown fox", "0123"], params)
    for out, body in zip(outputs, bodies, strict=True):
        assert out.finish_reason == "stop", out.text
        calls = tool_calls_of({"tools": tools, **body}, out.text)
        assert calls, out.text
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), parameters[name])
