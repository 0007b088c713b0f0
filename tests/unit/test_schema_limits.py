"""`core.schema_limits`: OpenAI's size limits on structured-output schemas, counted before
anything compiles, across every place a schema can hold properties and enums."""

from __future__ import annotations

from typing import Any

import pytest

from core import structured_outputs
from core.digest_cache import DigestCache
from core.schema_limits import (
    MAX_ENUM_VALUES,
    MAX_LONG_ENUM_CHARS,
    MAX_OBJECT_PROPERTIES,
    MAX_SCHEMA_CHARS,
    limit_problem,
    schema_size,
)
from core.structured_outputs import StructuredOutputError, check_output_schema


def enum_of(num_values: int, width: int = 1) -> dict[str, Any]:
    return {"type": "string", "enum": [f"{i:0{width}d}" for i in range(num_values)]}


def object_of(num_properties: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                             for i in range(num_properties)}}


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema}}}


def test_counts_reach_every_kind_of_subschema() -> None:
    """Properties and enums under items, prefixItems, the combinators, definitions and
    additionalProperties all count; enum and const values inside data do not."""
    two = object_of(2)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": two},
                       "b": {"type": "array", "prefixItems": [two, {"enum": ["x", "y"]}]},
                       "c": {"anyOf": [two, {"oneOf": [two]}, {"allOf": [two]}]},
                       "d": {"type": "object", "additionalProperties": two},
                       "e": {"const": {"properties": {"not": "counted"}}}},
        "$defs": {"D": two}, "definitions": {"E": {"enum": [1, 2, 3]}},
    }
    size = schema_size([schema])
    assert size.num_properties == 5 + 2 * 7
    assert size.num_enum_values == 5
    names = "abcde" + "p0p1" * 7 + "DE"
    assert size.num_chars == len(names) + len("xy") + len("123") + len(
        '{"properties": {"not": "counted"}}')


@pytest.mark.parametrize(("schemas", "problem"), [
    ([object_of(MAX_OBJECT_PROPERTIES + 1)], "5001 object properties"),
    ([object_of(3000), object_of(3000)], "6000 object properties"),  # tools share a budget
    ([enum_of(MAX_ENUM_VALUES + 1)], "1001 enum values"),
    ([{"anyOf": [enum_of(600), enum_of(600)]}], "1200 enum values"),
    ([enum_of(251, width=60)], f"has {251 * 60} characters; at most {MAX_LONG_ENUM_CHARS}"),
    ([{"enum": ["x" * MAX_SCHEMA_CHARS, "y"]}], f"at most {MAX_SCHEMA_CHARS}"),
    ([{"type": "object", "properties": {"k" * 70_000: {}},
       "$defs": {"d" * 50_001: {}}}], "120001 characters"),
])
def test_schemas_over_a_limit_name_it(schemas: list[Any], problem: str) -> None:
    assert problem in (limit_problem(schemas) or "")


@pytest.mark.parametrize("schemas", [
    [object_of(MAX_OBJECT_PROPERTIES)],
    [enum_of(MAX_ENUM_VALUES)],
    [enum_of(250, width=100)],  # a long enum, but of at most 250 values
    [enum_of(300, width=50)],  # 15,000 characters exactly
])
def test_schemas_at_the_limits_pass(schemas: list[Any]) -> None:
    assert limit_problem(schemas) is None


def test_a_deep_schema_is_counted_without_recursion() -> None:
    """Nested far beyond Python's recursion limit (the API bounds JSON depth; this module
    must not rely on it)."""
    schema: dict[str, Any] = {"enum": ["leaf"]}
    for _ in range(20_000):
        schema = {"type": "array", "items": schema}
    assert schema_size([schema]).num_enum_values == 1


def test_a_huge_enum_is_refused_before_anything_compiles(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The 55,000-value enum that stalled a worker ~50 s compiling: a 400 naming the field
    and the limit, and the grammar library never sees it."""
    def never(*args: object) -> None:
        raise AssertionError("compiled a schema over the limits")

    monkeypatch.setattr(structured_outputs, "_compiled_problem", never)
    with pytest.raises(StructuredOutputError) as refused:
        check_output_schema(response_format(enum_of(55_000)))
    assert refused.value.param == "response_format"
    assert "55000 enum values; at most 1000" in str(refused.value)


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_tools_share_one_budget_forced_or_auto(monkeypatch: pytest.MonkeyPatch,
                                               tool_choice: str) -> None:
    # A fresh cache: a result of the stand-in compiler must not outlive this test.
    monkeypatch.setattr(structured_outputs, "_compile_problems", DigestCache(max_entries=4))
    monkeypatch.setattr(structured_outputs, "_compiled_problem", lambda *a: None)
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": enum_of(400)}}
             for i in range(3)]
    with pytest.raises(StructuredOutputError) as refused:
        check_output_schema({"tools": tools, "tool_choice": tool_choice})
    assert refused.value.param == "tools" and "1200 enum values" in str(refused.value)
    check_output_schema({"tools": tools[:2], "tool_choice": tool_choice})
