"""`core.schema_keywords`: what xgrammar enforces passes, what it ignores is refused by name.

The two tables are the experiment that decided the rules: each row holds a JSON value
that breaks its schema (by `jsonschema`), and xgrammar's grammar for the schema (strict
mode, as the worker compiles it) refuses the value for every accepted row and takes it
for every refused one. A library upgrade that starts enforcing a keyword fails the second
test, which is the cue to accept the keyword.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from core.schema_keywords import keyword_problem
from core.structured_outputs import StructuredOutputError, check_output_schema

INT = {"type": "integer"}
DRAFT_7 = "http://json-schema.org/draft-07/schema#"

# (schema, a value that breaks it): accepted, and the grammar refuses the value.
ENFORCED: list[tuple[dict[str, Any], Any]] = [
    ({"type": "integer", "multipleOf": 3}, 4),
    ({"type": ["integer", "null"], "minimum": 3}, 2),
    ({"type": "number", "exclusiveMaximum": 1.5}, 1.5),
    ({"type": "string", "minLength": 3}, "ab"),
    ({"type": "string", "pattern": "^a+$"}, "ab"),
    ({"type": "string", "format": "date"}, "nope"),
    ({"type": "string", "format": "email"}, "nope"),
    ({"type": "array", "items": INT, "maxItems": 1}, [1, 2]),
    ({"type": "array", "prefixItems": [INT], "items": False}, [1, 2]),
    ({"type": "object", "properties": {"a": INT}, "required": ["a"]}, {}),
    ({"properties": {"a": INT}, "required": ["a"]}, {}),  # `properties` implies an object
    ({"type": "object", "additionalProperties": INT, "maxProperties": 1}, {"a": 1, "b": 2}),
    ({"type": "object", "additionalProperties": INT, "propertyNames": {"enum": ["a"]}},
     {"c": 1}),
    ({"type": "object", "patternProperties": {"^x.*$": INT}}, {"xa": "s"}),
    ({"type": "string", "enum": ["a", "b"]}, "c"),
    ({"const": {"a": [1]}}, {"a": [2]}),
    ({"anyOf": [INT, {"type": "null"}], "description": "d"}, "x"),
    ({"oneOf": [INT, {"type": "string"}]}, None),
    ({"allOf": [{"type": "integer", "minimum": 5}]}, 3),
    ({"$defs": {"A": {"type": "integer", "maximum": 3}}, "$ref": "#/$defs/A", "title": "t"}, 4),
    ({"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
      "required": ["c"]}, {"c": 1}),
    ({"type": "object", "properties": {"a": {"type": "string", "default": "x", "deprecated": True,
                                             "readOnly": True, "examples": ["y"]}},
      "required": ["a"], "additionalProperties": False, "title": "T", "x-order": ["a"],
      "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "urn:t",
      "$comment": "annotations and unknown keywords constrain nothing"}, {"a": 1}),
]

# (schema, keyword, path, a value that breaks it or None where jsonschema cannot tell):
# refused, naming keyword and path; where the grammar compiles, it takes the value.
REFUSED: list[tuple[dict[str, Any], str, str, Any]] = [
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}},
      "required": ["n"]}, "multipleOf", "properties.n", {"n": 1.3}),
    ({"type": "integer", "multipleOf": 5000}, "multipleOf", "the root", 5001),
    ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems", "the root", [1, 1]),
    ({"allOf": [INT, {"type": "string"}]}, "allOf", "the root", 3),
    ({"type": "integer", "not": {"const": 3}}, "not", "the root", 3),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 5}}, "if", "the root", 7),
    ({"type": "string", "format": "idn-email"}, "format", "the root", "nope"),
    ({"type": "string", "format": "regex"}, "format", "the root", "(("),
    ({"type": "array", "items": INT, "contains": {"const": 3}}, "contains", "the root", [1]),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired", "the root", {"a": 1}),
    ({"type": "object", "properties": {"a": INT, "b": INT},
      "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", "the root",
     {"a": 1}),
    ({"$schema": DRAFT_7, "type": "object", "properties": {"a": INT, "b": INT},
      "dependencies": {"a": ["b"]}}, "dependencies", "the root", {"a": 1}),
    ({"type": "object", "properties": {"xa": {"type": "integer", "minimum": 5}},
      "patternProperties": {"^x.*$": {"type": "integer", "maximum": 7}}, "required": ["xa"]},
     "patternProperties", "the root", {"xa": 9}),
    ({"type": "object", "properties": {"bbb": INT}, "propertyNames": {"maxLength": 2}},
     "propertyNames", "the root", {"bbb": 1}),
    ({"type": "object", "propertyNames": {"enum": ["a"]}, "additionalProperties": False},
     "propertyNames", "the root", {"a": 1}),
    ({"type": "object", "propertyNames": {"anyOf": [{"maxLength": 1}]}}, "anyOf",
     "propertyNames", {"ab": 1}),
    ({"type": "object", "properties": {"x": {"$ref": "http://example.com/s.json"}}}, "$ref",
     "properties.x", None),
    ({"$ref": "file:///etc/passwd"}, "$ref", "the root", None),
    ({"$defs": {"A": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, "$ref",
     "the root", "a"),
    ({"$defs": {"A": INT}, "$ref": "#/$defs/A", "minimum": 3}, "minimum", "the root", 2),
    ({"type": "string", "enum": ["a", "abc"], "minLength": 2}, "minLength", "the root", "a"),
    ({"type": "string", "enum": ["a", 1]}, "type", "the root", 1),
    ({"type": "integer", "minimum": 0, "anyOf": [{"type": "integer", "maximum": 5}]}, "type",
     "the root", -3),
    ({"minimum": 5}, "minimum", "the root", 4),
    ({"type": "array", "items": {"minItems": 2}}, "minItems", "items", [[1]]),
    ({"type": "object", "properties": {"b": INT}, "required": ["a"]}, "required", "the root",
     {"b": 1}),
    ({"type": "string", "format": "email", "maxLength": 6}, "maxLength", "the root",
     "abc@b.co"),
    ({"anyOf": [{"type": "string"}, {"$dynamicRef": "#meta"}]}, "$dynamicRef", "anyOf[1]",
     None),
    ({"type": "string", "contentMediaType": "application/json"}, "contentMediaType",
     "the root", None),
]


def grammar_takes(schema: dict[str, Any], value: Any) -> bool:
    """Whether the worker's grammar for `schema` accepts `value` as the model would write
    it (compact JSON, `", "` and `": "` separators)."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                           strict_mode=True)
    return bool(_is_grammar_accept_string(grammar, json.dumps(value)))


def is_valid(schema: dict[str, Any], value: Any) -> bool:
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return bool(validator(schema, format_checker=validator.FORMAT_CHECKER).is_valid(value))


@pytest.mark.parametrize(("schema", "breaking"), ENFORCED)
def test_what_the_grammar_enforces_is_accepted(schema: dict[str, Any], breaking: Any) -> None:
    assert keyword_problem(schema) is None
    assert not is_valid(schema, breaking)
    assert not grammar_takes(schema, breaking)


@pytest.mark.parametrize(("schema", "keyword", "path", "breaking"), REFUSED)
def test_what_the_grammar_ignores_is_refused_by_name(schema: dict[str, Any], keyword: str,
                                                     path: str, breaking: Any) -> None:
    problem = keyword_problem(schema)
    assert problem is not None and problem.startswith(
        f"the schema keyword '{keyword}' at {path} cannot be enforced"), problem
    if breaking is not None:  # the experiment: the library would have let it through
        assert not is_valid(schema, breaking)
        assert grammar_takes(schema, breaking)


def test_schemas_pydantic_and_the_openai_sdk_write_are_accepted() -> None:
    """Nested models ($defs and $ref), optional fields, literals, constrained strings and
    numbers, dates, dicts with literal keys."""
    import datetime
    from typing import Literal
    from uuid import UUID

    import openai
    import pydantic

    class Address(pydantic.BaseModel):
        city: Literal["Oslo", "Rome"]
        zip: str = pydantic.Field(max_length=5, description="Postal code.")

    class Order(pydantic.BaseModel):
        id: UUID
        to: Address
        cc: Address | None
        count: int = pydantic.Field(ge=1, le=9)
        when: datetime.date
        tags: dict[Literal["a", "b"], int]
        notes: list[str] = pydantic.Field(max_length=3)

    assert keyword_problem(Order.model_json_schema()) is None
    tool = openai.pydantic_function_tool(Order)
    check_output_schema({"tools": [tool], "tool_choice": "required"})
    check_output_schema({"tools": [tool]})


def test_a_deep_schema_is_walked_without_recursion() -> None:
    schema: dict[str, Any] = {"not": {}}
    for _ in range(20_000):
        schema = {"anyOf": [schema]}
    assert (keyword_problem(schema) or "").startswith("the schema keyword 'not' at anyOf[0]")


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": True,
                                                                 "schema": {
        "type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}}}},
     "response_format", "response_format: the schema keyword 'multipleOf' at properties.n "
                        "cannot be enforced"),
    ({"tools": [{"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "g", "parameters": {
                    "type": "object", "properties": {"u": {"$ref": "http://x/y.json"}}}}}],
      "tool_choice": "required"},
     "tools", "tools: the schema keyword '$ref' at tools[1].function.parameters.properties.u "
              "cannot be enforced: only local references"),
    ({"tools": [{"type": "function", "function": {"name": "g", "strict": True, "parameters": {
        "type": "object", "not": {"required": ["a"]}}}}]},
     "tools", "tools: the schema keyword 'not' at tools[0].function.parameters cannot"),
    # A `strict` that is not a boolean would turn those checks off unasked.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": "true",
                                                                 "schema": {"type": "object"}}}},
     "response_format.json_schema.strict",
     "response_format.json_schema.strict must be true or false, got 'true'"),
    ({"tools": [{"type": "function", "function": {"name": "g", "strict": 1}}],
      "tool_choice": "required"},
     "tools[0].function.strict", "tools[0].function.strict must be true or false, got 1"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "my schema",
                                                                 "schema": {"type": "object"}}}},
     "response_format.json_schema.name", "response_format.json_schema.name 'my schema' must"),
    # A reference the grammar cannot follow is refused with or without strict.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"u": {"$ref": "file:///etc/passwd"}}}}}},
     "response_format", "response_format: the schema keyword '$ref' at properties.u"),
])
def test_requests_are_refused_naming_the_field(body: dict[str, Any], param: str,
                                               message: str) -> None:
    """Before the library compiles anything: a remote ref never reaches its log."""
    with pytest.raises(StructuredOutputError) as refused:
        check_output_schema(body)
    assert refused.value.param == param
    assert str(refused.value).startswith(message), str(refused.value)


def test_without_strict_the_grammar_enforces_what_it_can() -> None:
    """OpenAI's default (`strict` absent or false) makes the schema a goal: keywords the
    grammar ignores are accepted, as vLLM accepts them, and the rest still hold."""
    schema = {"type": "object", "properties": {
        "n": {"type": "number", "multipleOf": 2}, "tags": {"type": "array", "uniqueItems": True,
                                                          "items": {"type": "string"}}},
        "required": ["n", "tags"], "additionalProperties": False}
    for strict in (None, False):
        spec: dict[str, Any] = {"name": "n", "schema": schema}
        if strict is not None:
            spec["strict"] = strict
        check_output_schema({"response_format": {"type": "json_schema", "json_schema": spec}})
        function: dict[str, Any] = {"name": "g", "parameters": schema}
        if strict is not None:
            function["strict"] = strict
        tool = {"type": "function", "function": function}
        check_output_schema({"tools": [tool], "tool_choice": "required"})
        check_output_schema({"tools": [tool]})
    assert grammar_takes(schema, {"n": 3, "tags": ["a", "a"]})  # what is not enforced
    assert not grammar_takes(schema, {"n": 3, "tags": ["a"], "x": 1})  # what is


def test_tools_that_are_not_enforced_are_not_checked() -> None:
    """`tool_choice: none`, or a response_format beside auto tools: the tools only reach
    the prompt, so nothing of theirs has to be enforceable."""
    tools = [{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "not": {}}}}]
    check_output_schema({"tools": tools, "tool_choice": "none"})
    check_output_schema({"tools": tools, "response_format": {"type": "json_object"}})
