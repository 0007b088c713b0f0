"""A tool's parameters moved inside a larger schema, its local `$ref`s still resolving.

A `$ref` such as `#/$defs/Address` points from the root of the document it sits in. A
forced tool call nests each tool's `parameters` under `properties.arguments` of a call
object (in a list for `required`), so the refs the tool wrote would point at the call
schema's root, where there is no `$defs`. `hoisted` moves the tool's `$defs` and
`definitions` to the root of the combined schema, under names prefixed with the tool's
name and a dot (function names cannot hold a dot, so two tools' `Address` cannot meet),
and re-points the tool's refs:

    #/$defs/Address/properties/zip  ->  #/$defs/get_weather.Address/properties/zip
    #/definitions/Unit              ->  #/definitions/get_weather.Unit
    #  (the parameters themselves)  ->  #/$defs/get_weather
    #/properties/unit               ->  #/$defs/get_weather/properties/unit

The last two need the parameters at the root too: they are then stored once, under
`$defs/<tool name>`, and the call's `arguments` refers to them there.
"""

from __future__ import annotations

from typing import Any

from core.schema_walk import copy_schema, walk

DEFINITION_KEYWORDS = ("$defs", "definitions")


def hoisted(parameters: dict[str, Any], name: str
            ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the schema of the tool's arguments, definitions for the combined schema's root:
    `{"$defs": {...}, "definitions": {...}}`, empty when the tool needs none)."""
    if not _needs_hoisting(parameters):
        return parameters, {}
    arguments = copy_schema(parameters)
    root_definitions: dict[str, dict[str, Any]] = {}
    hoisted_keywords = set()
    for keyword in DEFINITION_KEYWORDS:
        table = arguments.get(keyword)
        if isinstance(table, dict):
            del arguments[keyword]
            hoisted_keywords.add(keyword)
            root_definitions[keyword] = {f"{name}.{k}": v for k, v in table.items()}
    points_at_root = False
    schemas = [arguments, *(d for table in root_definitions.values() for d in table.values())]
    for schema in schemas:
        for _, node in walk(schema):
            ref = node.get("$ref")
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                continue  # not local: refused before this, or left to the library
            _, keyword, rest = (ref[1:] + "/").split("/", 2) if ref != "#" else ("", "", "")
            if keyword in hoisted_keywords and rest:
                node["$ref"] = f"#/{keyword}/{name}.{rest.removesuffix('/')}"
            else:
                node["$ref"] = f"#/$defs/{name}{ref[1:]}"
                points_at_root = True
    if points_at_root:
        root_definitions.setdefault("$defs", {})[name] = arguments
        return {"$ref": f"#/$defs/{name}"}, root_definitions
    return arguments, root_definitions


def _needs_hoisting(parameters: dict[str, Any]) -> bool:
    """Whether the parameters hold definitions or local refs (most hold neither)."""
    if any(keyword in parameters for keyword in DEFINITION_KEYWORDS):
        return True
    return any(isinstance(node.get("$ref"), str) and node["$ref"].startswith("#")
               for _, node in walk(parameters))


def merge_definitions(schema: dict[str, Any], definitions: dict[str, dict[str, Any]]) -> None:
    """Add hoisted definitions (see `hoisted`) to the root of `schema`."""
    for keyword, table in definitions.items():
        schema.setdefault(keyword, {}).update(table)
