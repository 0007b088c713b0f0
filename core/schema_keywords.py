"""Which JSON-schema keywords the grammar enforces, and a check that refuses the others.

xgrammar compiles many keywords it does not enforce: it ignores them (some with a warning
line in the log) and the output then breaks them, though the request asked for `strict`.
So a `strict` schema that uses one is refused at submission, naming the keyword and where
it is; a schema without `strict` gets what the grammar enforces.
What xgrammar 0.2.9 enforces was found by experiment (compile with `strict_mode=True`,
then test strings that break the keyword; tests/unit/test_schema_keywords.py repeats it
and docs/structured-outputs.md has the table). In short:

- enforced: `type`, `enum`, `const`, `anyOf`, `oneOf` (as anyOf where branches overlap),
  `allOf` of one schema, local `$ref` (`#`, `#/...`), `$defs`/`definitions`; numbers'
  `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, integers' `multipleOf`
  (1-1024); strings' `minLength`, `maxLength`, `pattern`, some `format`s; arrays' `items`,
  `prefixItems`, `unevaluatedItems`, `minItems`, `maxItems`; objects' `properties`,
  `required`, `additionalProperties`, `unevaluatedProperties`, `minProperties`,
  `maxProperties`, `patternProperties` and simple `propertyNames`;
- but only where the library looks: it reads one of `$ref`, `anyOf`, `oneOf`, `allOf`,
  `enum`, `const` and ignores the constraints beside it; it applies a type's keywords only
  when `type` names the type (or `properties`/`items` imply object/array); it ignores
  `required` names missing from `properties`, lengths beside `format`, and `propertyNames`
  beside `properties`;
- never: `not`, `if`/`then`/`else`, `contains`, `uniqueItems`, `dependentRequired`,
  `dependentSchemas`, `dependencies`, `additionalItems`, the `content*` keywords,
  `$dynamicRef`/`$recursiveRef`, and `$ref`s that are not local (read as any JSON).

Annotations (`title`, `description`, ...) and keywords outside JSON Schema's vocabulary
constrain nothing and pass. The walk is iterative and linear (`core.schema_walk`).
"""

from __future__ import annotations

import json
from typing import Any

from core.schema_walk import SchemaPath, path_text, walk

# Never enforced, whatever surrounds them.
NEVER_ENFORCED = frozenset({
    "not", "if", "then", "else", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "dependencies", "additionalItems",
    "contentEncoding", "contentMediaType", "contentSchema", "$dynamicRef", "$dynamicAnchor",
    "$recursiveRef", "$recursiveAnchor",
})
# The library reads one of these per schema and ignores the constraints beside it.
SOLE_KEYWORDS = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
# Keywords that constrain one type of value, and the types they constrain.
KEYWORD_TYPES: dict[str, frozenset[str]] = {
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                     "multipleOf"), frozenset({"integer", "number"})),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), frozenset({"string"})),
    **dict.fromkeys(("items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"),
                    frozenset({"array"})),
    **dict.fromkeys(("properties", "additionalProperties", "unevaluatedProperties",
                     "required", "minProperties", "maxProperties", "patternProperties",
                     "propertyNames"), frozenset({"object"})),
}
# Without `type`, these make the library read the schema as an object or an array.
OBJECT_IMPLYING = frozenset({"properties", "additionalProperties", "unevaluatedProperties"})
ARRAY_IMPLYING = frozenset({"items", "prefixItems", "unevaluatedItems"})
# Everything that constrains a value; the rest (annotations, `$defs`, unknown keywords)
# constrains nothing.
CONSTRAINTS = NEVER_ENFORCED | set(SOLE_KEYWORDS) | set(KEYWORD_TYPES) | {"type", "uniqueItems"}
# What a `propertyNames` schema may hold (a name is a string; nothing else is enforced).
NAME_KEYWORDS = frozenset({"type", "enum", "const", "minLength", "maxLength", "pattern"})
# The `format`s whose strings the library constrains (checked by shape: `2024-02-30`
# passes as a date).
ENFORCED_FORMATS = frozenset({
    "date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# The library ignores a larger or fractional `multipleOf` on integers.
MAX_MULTIPLE_OF = 1024


def keyword_problem(schema: object, root: SchemaPath = None, *, strict: bool = True
                    ) -> str | None:
    """Why `schema` holds a keyword the grammar would not enforce (naming the keyword and
    its path under `root`), or None.

    Without `strict` (OpenAI's default: the schema is a goal, not a promise) the grammar
    enforces what it can and only a `$ref` it cannot follow is refused: the library reads
    it as any JSON and logs the client's URL.
    """
    for path, node in walk(schema, root):
        is_name = path is not None and path[1] == ".propertyNames"
        problem = (_node_problem(node, is_name=is_name) if strict
                   else _ref_problem(node.get("$ref")))
        if problem is not None:
            keyword, why = problem
            return f"the schema keyword '{keyword}' at {path_text(path)} cannot be enforced{why}"
    return None


def _node_problem(node: dict[str, Any], *, is_name: bool) -> tuple[str, str] | None:
    """(keyword, why) for the first keyword of one schema object the grammar would not
    enforce; its subschemas are walked on their own."""
    for keyword, value in node.items():
        if keyword in NEVER_ENFORCED or (keyword == "uniqueItems" and value is not False):
            return keyword, ""
        if is_name and keyword in CONSTRAINTS and keyword not in NAME_KEYWORDS:
            return keyword, " in propertyNames (only type, enum, const, minLength, maxLength " \
                            "and pattern are)"
    sole = next((k for k in SOLE_KEYWORDS if k in node), None)
    if sole is not None:
        return _sole_problem(node, sole)
    types = {"string"} if is_name else _types(node)
    for keyword, value in node.items():
        kinds = KEYWORD_TYPES.get(keyword)
        if kinds is None:
            continue
        if types is None:
            return keyword, " without a 'type' naming the kind of value it constrains"
        if types & kinds:  # else it constrains no value the schema allows: nothing to do
            why = _typed_problem(node, keyword, value, types)
            if why is not None:
                return keyword, why
    return None


def _sole_problem(node: dict[str, Any], sole: str) -> tuple[str, str] | None:
    for keyword in node:
        if keyword == sole or keyword not in CONSTRAINTS:
            continue
        if keyword == "type" and sole in ("enum", "const"):
            continue  # checked against the values below
        return keyword, f" beside '{sole}'"
    value = node[sole]
    if sole == "$ref" and (problem := _ref_problem(value)) is not None:
        return problem
    if sole == "allOf" and isinstance(value, list) and len(value) != 1:
        return "allOf", ": only an allOf of one schema can be"
    if sole in ("enum", "const") and "type" in node:
        types = _types(node) or set()
        values = value if sole == "enum" and isinstance(value, list) else [value]
        for v in values:
            if not any(_is_of_type(v, t) for t in types):
                return "type", f": the {sole} value {json.dumps(v)[:40]} is not of that type"
    return None


def _ref_problem(ref: object) -> tuple[str, str] | None:
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return "$ref", ": only local references ('#' or '#/...') can be followed"
    return None


def _typed_problem(node: dict[str, Any], keyword: str, value: Any, types: set[str]
                   ) -> str | None:
    """Why a keyword that applies to the schema's type is not enforced there, or None."""
    if keyword == "multipleOf":
        if "number" in types:
            return ": only on integers ('type': 'integer'), not numbers"
        if not (_is_of_type(value, "integer") and 0 < value <= MAX_MULTIPLE_OF):
            return f": only a whole multipleOf from 1 to {MAX_MULTIPLE_OF} can be"
    elif keyword == "format" and value not in ENFORCED_FORMATS:
        return (f": format {json.dumps(value)[:40]} is not one of "
                f"{', '.join(sorted(ENFORCED_FORMATS))}")
    elif keyword in ("minLength", "maxLength", "pattern") and "format" in node:
        return " beside 'format'"
    elif keyword == "required" and isinstance(value, list):
        properties = node.get("properties")
        names = properties if isinstance(properties, dict) else {}
        missing = next((n for n in value if n not in names), None)
        if missing is not None:
            return f": {json.dumps(missing)[:40]} is not among its properties"
    elif keyword == "patternProperties" and "properties" in node:
        return " beside 'properties'"
    elif keyword == "propertyNames":
        beside = next((k for k in ("properties", "patternProperties") if k in node), None)
        if beside is not None:
            return f" beside '{beside}'"
        if node.get("additionalProperties") is False:
            return " beside 'additionalProperties': false"
    return None


def _types(node: dict[str, Any]) -> set[str] | None:
    """The types a schema names, or those its keywords imply; None if neither."""
    named = node.get("type")
    if isinstance(named, str):
        return {named}
    if isinstance(named, list):
        return {t for t in named if isinstance(t, str)}
    implied = set()
    if not OBJECT_IMPLYING.isdisjoint(node):
        implied.add("object")
    if not ARRAY_IMPLYING.isdisjoint(node):
        implied.add("array")
    return implied or None


def _is_of_type(value: Any, kind: str) -> bool:
    """Whether a JSON value is of a JSON-schema type (2.0 is an integer, true is not)."""
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    expected = {"string": str, "boolean": bool, "null": type(None), "array": list,
                "object": dict}.get(kind)
    return expected is not None and isinstance(value, expected)
