"""How big a structured-output schema may be: OpenAI's documented limits, counted cheaply.

Compiling a schema into a grammar costs far more than linear time in its size: with
SmolLM2's tokenizer a string enum of 5,000 values compiles in 0.06 s, 10,000 in 1.8 s,
20,000 in 7.1 s, and one of 55,000 stalled a worker for ~50 s. So a schema over these
limits is refused before anything compiles it. The limits are those OpenAI documents for
structured outputs, so a schema OpenAI accepts is accepted here too. Counting walks the
schema once (`core.schema_walk`, no recursion): linear in its size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from core.schema_walk import walk

# Object properties across the whole schema (every `properties` map counted).
MAX_OBJECT_PROPERTIES = 5000
# Enum values across the whole schema (every `enum` counted).
MAX_ENUM_VALUES = 1000
# A string enum with more values than this must keep its values short...
MAX_SHORT_ENUM_VALUES = 250
# ...at most this many characters in all.
MAX_LONG_ENUM_CHARS = 15_000
# Characters of every property name, definition name, enum value and const value.
MAX_SCHEMA_CHARS = 120_000


@dataclass(slots=True)
class SchemaSize:
    """What the limits count, summed over one or more schemas."""

    num_properties: int = 0
    num_enum_values: int = 0
    num_chars: int = 0
    # The string enum with the most characters among those with over 250 values.
    max_long_enum_chars: int = 0


def schema_size(schemas: Iterable[object]) -> SchemaSize:
    """The counts of `schemas` together (a request's tools share one budget)."""
    size = SchemaSize()
    for schema in schemas:
        for _, node in walk(schema):
            properties = node.get("properties")
            if isinstance(properties, dict):
                size.num_properties += len(properties)
                size.num_chars += sum(map(len, properties))
            for keyword in ("$defs", "definitions"):
                definitions = node.get(keyword)
                if isinstance(definitions, dict):
                    size.num_chars += sum(map(len, definitions))
            enum = node.get("enum")
            if isinstance(enum, list):
                size.num_enum_values += len(enum)
                size.num_chars += sum(_value_chars(v) for v in enum)
                strings = [v for v in enum if isinstance(v, str)]
                if len(strings) > MAX_SHORT_ENUM_VALUES:
                    size.max_long_enum_chars = max(size.max_long_enum_chars,
                                                   sum(map(len, strings)))
            if "const" in node:
                size.num_chars += _value_chars(node["const"])
    return size


def limit_problem(schemas: Iterable[object]) -> str | None:
    """Which limit `schemas` together exceed, or None."""
    size = schema_size(schemas)
    if size.num_properties > MAX_OBJECT_PROPERTIES:
        return (f"it has {size.num_properties} object properties; at most "
                f"{MAX_OBJECT_PROPERTIES} are allowed in total")
    if size.num_enum_values > MAX_ENUM_VALUES:
        return (f"it has {size.num_enum_values} enum values; at most {MAX_ENUM_VALUES} are "
                f"allowed in total")
    if size.max_long_enum_chars > MAX_LONG_ENUM_CHARS:
        return (f"a string enum of more than {MAX_SHORT_ENUM_VALUES} values has "
                f"{size.max_long_enum_chars} characters; at most {MAX_LONG_ENUM_CHARS} are "
                f"allowed")
    if size.num_chars > MAX_SCHEMA_CHARS:
        return (f"its property names, definition names, enum values and const values have "
                f"{size.num_chars} characters; at most {MAX_SCHEMA_CHARS} are allowed")
    return None


def _value_chars(value: Any) -> int:
    """A string's length; any other value's, as its JSON text (an enum may hold objects)."""
    if isinstance(value, str):
        return len(value)
    return len(json.dumps(value))
