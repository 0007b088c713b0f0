"""Forced tool calls whose parameters use `$defs` and `$ref`, as pydantic writes them: the
definitions move to the combined schema's root, per tool, and the refs follow them."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest

from core.schema_refs import hoisted
from core.structured_outputs import check_output_schema, tool_call_schema

# Two tools whose `Address` definitions share a name and differ.
SEND = {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}},
        "required": ["to"], "additionalProperties": False,
        "$defs": {"Address": {"type": "object", "properties": {"city": {"enum": ["Oslo"]}},
                              "required": ["city"], "additionalProperties": False}}}
SHIP = {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"},
                                         "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                         "unit": {"$ref": "#/definitions/Unit"},
                                         "same": {"$ref": "#/properties/unit"}},
        "required": ["to", "next", "unit", "same"], "additionalProperties": False,
        "$defs": {"Address": {"type": "object", "properties": {"port": {"enum": [7]}},
                              "required": ["port"], "additionalProperties": False}},
        "definitions": {"Unit": {"enum": ["kg"]}}}
TOOLS = [{"type": "function", "function": {"name": "send", "parameters": SEND}},
         {"type": "function", "function": {"name": "ship", "parameters": SHIP}}]

SEND_CALL = {"name": "send", "arguments": {"to": {"city": "Oslo"}}}
SHIP_ARGUMENTS = {"to": {"port": 7}, "next": None, "unit": "kg", "same": "kg"}
SHIP_CALL = {"name": "ship", "arguments": {**SHIP_ARGUMENTS, "next": SHIP_ARGUMENTS}}
# Each tool's arguments with the other's `Address`: valid for neither.
SWAPPED = [{"name": "send", "arguments": {"to": {"port": 7}}},
           {"name": "ship", "arguments": {**SHIP_ARGUMENTS, "to": {"city": "Oslo"}}}]


def grammar_takes(schema: dict[str, Any], value: Any) -> bool:
    """Whether the worker's grammar for `schema` accepts `value` written compactly."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                           strict_mode=True)
    return bool(_is_grammar_accept_string(grammar, json.dumps(value)))


def test_required_calls_compile_and_keep_each_tools_definitions_apart() -> None:
    schema = tool_call_schema(TOOLS, "required")
    assert schema is not None
    assert set(schema["$defs"]) == {"send.Address", "ship.Address", "ship"}
    assert set(schema["definitions"]) == {"ship.Unit"}
    check_output_schema({"tools": TOOLS, "tool_choice": "required"})  # the library compiles it
    assert grammar_takes(schema, [SEND_CALL, SHIP_CALL])
    for call in SWAPPED:
        assert not grammar_takes(schema, [call])
    # The schema says what the tools' own parameters say.
    jsonschema.validate([SEND_CALL, SHIP_CALL], schema)
    jsonschema.validate(SHIP_CALL["arguments"], SHIP)
    for call in SWAPPED:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([call], schema)


def test_a_named_call_carries_its_definitions_at_its_root() -> None:
    choice = {"type": "function", "function": {"name": "ship"}}
    schema = tool_call_schema(TOOLS, choice)
    assert schema is not None and schema["properties"]["arguments"] == {"$ref": "#/$defs/ship"}
    check_output_schema({"tools": TOOLS, "tool_choice": choice})
    assert grammar_takes(schema, SHIP_CALL)
    assert not grammar_takes(schema, SWAPPED[1])


@pytest.mark.parametrize(("ref", "expected"), [
    ("#/$defs/Address", "#/$defs/f.Address"),
    ("#/$defs/Address/properties/city", "#/$defs/f.Address/properties/city"),
    ("#/$defs/A~1B", "#/$defs/f.A~1B"),  # an escaped '/' stays escaped
    ("#/definitions/Unit", "#/definitions/f.Unit"),
    ("#", "#/$defs/f"),
    ("#/properties/to", "#/$defs/f/properties/to"),
])
def test_local_refs_are_re_pointed(ref: str, expected: str) -> None:
    parameters = {"type": "object", "properties": {"to": {"$ref": ref}},
                  "$defs": {"Address": {}, "A/B": {}}, "definitions": {"Unit": {}}}
    arguments, definitions = hoisted(parameters, "f")
    root = arguments if "properties" in arguments else definitions["$defs"]["f"]
    assert root["properties"]["to"]["$ref"] == expected
    assert "$defs" not in root and "definitions" not in root


def test_parameters_without_refs_are_left_as_they_are() -> None:
    """And the client's parameters are never changed in place."""
    plain = {"type": "object", "properties": {"a": {"enum": [{"$ref": "#/data"}]}}}
    assert hoisted(plain, "f") == (plain, {})
    before = copy.deepcopy(TOOLS)
    tool_call_schema(TOOLS, "required")
    assert TOOLS == before
