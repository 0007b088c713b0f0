"""Every subschema of a JSON schema, reached without recursion.

Client schemas can nest as deep as their JSON does, so nothing here recurses: `walk`
keeps its own stack. It follows the keywords that hold subschemas (`properties`,
`items`, `anyOf`, `$defs`, ...) and never the ones that hold data (`enum`, `const`,
`default`, `examples`), so a `"$ref"` key inside an enum value is data, not a reference.
It does not follow `$ref` either: each subschema is reached once, so a walk costs time
linear in the schema's size, however its references point.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Keywords whose value is one subschema (a dict; `true`/`false` hold nothing to walk).
ONE_SCHEMA_KEYWORDS = frozenset({
    "items", "additionalItems", "additionalProperties", "unevaluatedItems",
    "unevaluatedProperties", "contains", "propertyNames", "not", "if", "then", "else",
    "contentSchema",
})
# Keywords whose value is a list of subschemas (`items` in draft 4's tuple form too).
LIST_KEYWORDS = frozenset({"prefixItems", "anyOf", "oneOf", "allOf", "items"})
# Keywords whose value maps names to subschemas (`dependencies` also maps to name lists).
MAP_KEYWORDS = frozenset({
    "properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
    "dependencies",
})

# Where a subschema sits, as a linked list (parent, step) so that a step costs O(1)
# however deep it is; `path_text` spells it out only for a message. None is the root.
SchemaPath = tuple[Any, str] | None


def path_text(path: SchemaPath) -> str:
    """`path` as `properties.address.anyOf[0]`; 'the root' for the root."""
    steps: list[str] = []
    while path is not None:
        path, step = path
        steps.append(step)
    return "".join(reversed(steps)).lstrip(".") or "the root"


def child_slots(node: dict[str, Any]) -> list[tuple[dict[str, Any] | list[Any], Any, str]]:
    """(container, key, step) for each subschema `node` holds: `container[key]` is it."""
    slots: list[tuple[dict[str, Any] | list[Any], Any, str]] = []
    for keyword, value in node.items():
        if isinstance(value, dict) and keyword in ONE_SCHEMA_KEYWORDS:
            slots.append((node, keyword, f".{keyword}"))
        elif isinstance(value, list) and keyword in LIST_KEYWORDS:
            slots.extend((value, i, f".{keyword}[{i}]") for i in range(len(value)))
        elif isinstance(value, dict) and keyword in MAP_KEYWORDS:
            slots.extend((value, name, f".{keyword}.{name}") for name in value)
    return slots


def walk(schema: object, root: SchemaPath = None) -> Iterator[tuple[SchemaPath, dict[str, Any]]]:
    """(path, subschema) for `schema` and every object subschema under it, parents first."""
    stack: list[tuple[SchemaPath, object]] = [(root, schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue  # a boolean schema, or junk the grammar library refuses itself
        yield path, node
        for container, key, step in reversed(child_slots(node)):
            stack.append(((path, step), container[key]))  # type: ignore[index]


def copy_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` whose subschemas (and the lists and maps holding them) are new
    objects, free to change; data values (`enum`, `const`, ...) are shared."""
    root = dict(schema)
    stack = [root]
    while stack:
        node = stack.pop()
        for keyword, value in list(node.items()):
            if isinstance(value, list) and keyword in LIST_KEYWORDS:
                node[keyword] = list(value)
            elif isinstance(value, dict) and keyword in MAP_KEYWORDS:
                node[keyword] = dict(value)
        for container, key, _ in child_slots(node):
            child = container[key]  # type: ignore[index]
            if isinstance(child, dict):
                container[key] = copied = dict(child)  # type: ignore[index]
                stack.append(copied)
    return root
