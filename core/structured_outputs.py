"""`response_format` and `tools` → the JSON schema the engine's grammar enforces.

Responsible for: reading OpenAI's `response_format` (`text`, `json_object`, `json_schema`)
and `tools` + `tool_choice` into one JSON schema (or none), and checking that the grammar
library can compile it, so the API refuses a bad schema at submission (400 naming the
problem) and a worker never meets one. The API and the workers call the same functions.

Forced tool calls (`tool_choice` `required` or a named function) make the whole output a
JSON list of `{"name", "arguments"}` objects (one object for a named function), which the
worker turns into OpenAI's `tool_calls`. With `auto` the text stays free, but a call the
model opens in the Hermes format (`<tool_call>` ... `</tool_call>`, what tool_prompt asks
for and Qwen/Hermes templates use) is constrained from its trigger on: it names one of the
tools and carries arguments that tool's schema accepts (`auto_tool_tag`, an xgrammar
structural tag). See docs/structured-outputs.md.

Before anything compiles, a schema must keep within OpenAI's size limits
(`core.schema_limits`: compile time grows much faster than size) and use only keywords the
grammar enforces (`core.schema_keywords`); both checks are linear walks, run wherever a
schema is built (`output_schema`, `auto_tool_tag`), so the workers apply them too.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Literal

from core.digest_cache import DigestCache
from core.schema_keywords import keyword_problem
from core.schema_limits import limit_problem
from core.schema_refs import hoisted, merge_definitions

JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

# xgrammar prefixes its messages with a time and a C++ source position.
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")

ToolMode = Literal["none", "auto", "required", "named"]
# A call in the Hermes format opens with this; the grammar takes over from it.
TOOL_CALL_TRIGGER = "<tool_call>"
# Consecutive whitespace characters a constrained call's arguments may hold.
MAX_CALL_WHITESPACE = 16


class StructuredOutputError(ValueError):
    """A `response_format`, `tools` or `tool_choice` that cannot be honoured; names `param`."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def response_format_schema(response_format: object) -> dict[str, Any] | None:
    """The schema of `response_format` (None for absent or `text`); StructuredOutputError."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise StructuredOutputError("response_format must be an object with a 'type'.",
                                    param="response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise StructuredOutputError(
                "response_format.json_schema must be an object with a 'name' and a 'schema'.",
                param="response_format.json_schema")
        _check_strict(spec, "response_format.json_schema.strict")
        if not FUNCTION_NAME.fullmatch(spec["name"]):
            raise StructuredOutputError(
                f"response_format.json_schema.name {spec['name'][:80]!r} must be 1-64 "
                "letters, digits, underscores or dashes.",
                param="response_format.json_schema.name")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise StructuredOutputError("response_format.json_schema.schema must be an object.",
                                        param="response_format.json_schema.schema")
        return schema
    raise StructuredOutputError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
        param="response_format.type")


def tool_mode(tools: object, tool_choice: object) -> tuple[ToolMode, str | None]:
    """(mode, the named function or None); OpenAI's default is `auto` with tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise StructuredOutputError("tool_choice needs tools.", param="tool_choice")
        return "none", None
    if tool_choice is None or tool_choice == "auto":
        return "auto", None
    if tool_choice in ("none", "required"):
        return tool_choice, None  # type: ignore[return-value]
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return "named", function["name"]
    raise StructuredOutputError(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}.', param="tool_choice")


# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}


def _check_strict(spec: dict[str, Any], param: str) -> None:
    """`strict` is true, false or left out: "true" or 1 read as not strict would skip the
    keyword checks the client asked for, so anything else is refused."""
    value = spec.get("strict")
    if value is not None and not isinstance(value, bool):
        raise StructuredOutputError(f"{param} must be true or false, got {value!r:.40}.",
                                    param=param)


def functions_of(tools: object) -> dict[str, dict[str, Any]]:
    """Tool name → its `function` object; StructuredOutputError naming the bad tool."""
    if not isinstance(tools, list):
        raise StructuredOutputError("tools must be a list.", param="tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                function, dict) or not isinstance(function.get("name"), str):
            raise StructuredOutputError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                f'"parameters": ...}}}}; other tool types are not supported.',
                param=f"tools[{i}]")
        _check_strict(function, f"tools[{i}].function.strict")
        name = function["name"]
        if not FUNCTION_NAME.fullmatch(name):
            raise StructuredOutputError(
                f"tools[{i}].function.name {name!r} must be 1-64 letters, digits, "
                f"underscores or dashes.", param=f"tools[{i}].function.name")
        if name in functions:
            raise StructuredOutputError(f"tools[{i}].function.name {name!r} names two tools.",
                                        param=f"tools[{i}].function.name")
        parameters = parameters_of(function)
        if not isinstance(parameters, dict):
            raise StructuredOutputError(f"tools[{i}].function.parameters must be an object.",
                                        param=f"tools[{i}].function.parameters")
        functions[name] = function
    return functions


def parameters_of(function: dict[str, Any]) -> Any:
    """A function's `parameters`; without them it takes none, as OpenAI reads it (a
    bare object schema let the model invent arguments until max_tokens)."""
    return function.get("parameters", NO_PARAMETERS)


def tool_call_schema(tools: object, tool_choice: object,
                     parallel_tool_calls: object = None) -> dict[str, Any] | None:
    """The schema of the forced call(s): None unless `tool_choice` is required or named."""
    mode, name = tool_mode(tools, tool_choice)
    if mode in ("none", "auto"):
        if tools:
            functions_of(tools)  # still refuse a malformed tool list
        return None
    functions = functions_of(tools)
    if mode == "named":
        if name not in functions:
            raise StructuredOutputError(
                f"tool_choice names {name!r}, which is not among the tools.",
                param="tool_choice")
        call, definitions = _call_schema(name, functions[name])
        merge_definitions(call, definitions)
        return call
    calls: dict[str, Any] = {"type": "array", "items": {"anyOf": []}, "minItems": 1}
    if parallel_tool_calls is False:
        calls["maxItems"] = 1
    for n, f in functions.items():
        call, definitions = _call_schema(n, f)
        calls["items"]["anyOf"].append(call)
        merge_definitions(calls, definitions)
    return calls


def _call_schema(name: str, function: dict[str, Any]
                 ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(one call's schema, the definitions its arguments need at the root: see
    core.schema_refs; the arguments sit two or three levels below it)."""
    arguments, definitions = hoisted(parameters_of(function), name)
    call = {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return call, definitions


def _check_enforceable(schemas: list[tuple[object, str | None, bool]], *,
                       compiled: list[object], param: str) -> None:
    """StructuredOutputError unless `compiled` (what the grammar will be built from) keeps
    within the size limits and each of `schemas` (as the client wrote it, with the path
    its messages start from, and whether it is `strict`) uses only keywords the grammar
    enforces (a schema without `strict`: only references it can follow)."""
    problem = limit_problem(compiled)
    if problem is not None:
        raise StructuredOutputError(f"{param}: the JSON schema is too large: {problem}.",
                                    param=param)
    for schema, root, strict in schemas:
        problem = keyword_problem(schema, None if root is None else (None, root),
                                  strict=strict)
        if problem is not None:
            raise StructuredOutputError(f"{param}: {problem}.", param=param)


def _tool_parameters(tools: object) -> list[tuple[object, str | None, bool]]:
    return [(parameters_of(function), f"tools[{i}].function.parameters",
             function.get("strict") is True)
            for i, function in enumerate(functions_of(tools).values())]


def auto_tool_tag(body: dict[str, Any]) -> dict[str, Any] | None:
    """With tools left to the model (`auto`) and no `response_format`: the structural tag
    that leaves text free and constrains each Hermes-format call it opens (see the module
    docstring); None otherwise. `parallel_tool_calls: false` ends the constraint, and so
    any further call, after the first."""
    tools = body.get("tools")
    mode, _ = tool_mode(tools, body.get("tool_choice"))
    if mode != "auto" or not tools or response_format_schema(body.get("response_format")):
        return None
    parameters = _tool_parameters(tools)
    _check_enforceable(parameters, compiled=[schema for schema, _, _ in parameters],
                       param="tools")
    tags = [{"type": "tag",
             "begin": f'{TOOL_CALL_TRIGGER}\n{{"name": {json.dumps(name)}, "arguments": ',
             "content": {"type": "json_schema",
                         "json_schema": parameters_of(function),
                         # Room for indented JSON, none for a run of blanks that never ends.
                         "max_whitespace_cnt": MAX_CALL_WHITESPACE},
             "end": "}\n</tool_call>"}
            for name, function in functions_of(tools).items()]
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": [TOOL_CALL_TRIGGER], "tags": tags,
                       "at_least_one": False,
                       "stop_after_first": body.get("parallel_tool_calls") is False}}


def output_schema(body: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(the schema a request's output must follow or None, the field it came from);
    StructuredOutputError for one the grammar could not enforce (too large, or a keyword
    it ignores).

    `response_format` and forced tool calls cannot both constrain one output.
    """
    tools_schema = tool_call_schema(body.get("tools"), body.get("tool_choice"),
                                    body.get("parallel_tool_calls"))
    format_schema = response_format_schema(body.get("response_format"))
    if tools_schema is not None and format_schema is not None:
        raise StructuredOutputError(
            "response_format and a forced tool_choice cannot both constrain the output; "
            "drop one.", param="response_format")
    if tools_schema is not None:
        _check_enforceable(_tool_parameters(body.get("tools")), compiled=[tools_schema],
                           param="tools")
        return tools_schema, "tools"
    if format_schema is not None:
        spec = body["response_format"].get("json_schema")
        strict = isinstance(spec, dict) and spec.get("strict") is True
        _check_enforceable([(format_schema, None, strict)], compiled=[format_schema],
                           param="response_format")
    return format_schema, "response_format"


def compile_problem(schema: dict[str, Any]) -> str | None:
    """Why the grammar library cannot compile `schema`, or None when it can.

    Needs no tokenizer (the vocabulary only matters to the masks), so the API can check.
    """
    return _compile_problem(json.dumps(schema, sort_keys=True))


# Batch files repeat one schema on every line; keyed by digest, not by the schema's text.
_compile_problems: DigestCache[str | None] = DigestCache(max_entries=256)


def _compile_problem(schema_text: str, *, is_tag: bool = False) -> str | None:
    return _compile_problems.get(schema_text, lambda: _compiled_problem(schema_text, is_tag),
                                 kind="tag" if is_tag else "schema")


def _compiled_problem(schema_text: str, is_tag: bool) -> str | None:
    import xgrammar as xgr

    try:
        if is_tag:
            xgr.Grammar.from_structural_tag(schema_text)
        else:
            xgr.Grammar.from_json_schema(schema_text, any_whitespace=False, strict_mode=True)
    except Exception as e:  # noqa: BLE001 - xgrammar raises several types; all mean "cannot"
        return _NATIVE_PREFIX.sub("", str(e).strip()) or type(e).__name__
    return None


def is_library_loaded() -> bool:
    """Whether checking a schema is cheap now: the first check imports the library (and
    torch with it), seconds that must not run on the API's event loop."""
    return "xgrammar" in sys.modules


def constrains_output(body: dict[str, Any]) -> bool:
    """Whether a request has a schema to check (a cheap look at its fields)."""
    response_format = body.get("response_format")
    has_format = isinstance(response_format, dict) and response_format.get("type") not in (
        None, "text")
    return has_format or (bool(body.get("tools")) and body.get("tool_choice") != "none")


def check_output_schema(body: dict[str, Any]) -> None:
    """StructuredOutputError naming the field when the output's schema cannot be enforced."""
    schema, param = output_schema(body)
    if schema is not None:
        problem = compile_problem(schema)
        if problem is not None:
            raise StructuredOutputError(
                f"{param}: the JSON schema cannot be enforced: {problem}", param=param)
    tag = auto_tool_tag(body)
    if tag is not None:
        problem = _compile_problem(json.dumps(tag, sort_keys=True), is_tag=True)
        if problem is not None:
            raise StructuredOutputError(
                f"tools: the functions' parameters cannot be enforced: {problem}",
                param="tools")
