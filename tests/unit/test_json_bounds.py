"""`core.json_bounds`: depth and value counts read from raw text, as the parser would."""

from __future__ import annotations

import json

import pytest

from core.json_bounds import MAX_JSON_DEPTH, json_bounds_error


def test_ordinary_bodies_pass() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert json_bounds_error(json.dumps(body).encode()) is None
    assert json_bounds_error(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) is None


@pytest.mark.parametrize("raw", [
    b"[" * (MAX_JSON_DEPTH + 1),  # unclosed: the parser would still recurse into it
    b'{"a": ' + b"[{" * 40 + b"}]" * 40 + b"}",
    ('{"a":' + "[" * 100 + "]" * 100 + "}").encode("utf-16"),
    ('{"a":' + "[" * 100 + "]" * 100 + "}").encode("utf-32-le"),
    b'{"a": "\\\\", "b": ' + b"[" * 100 + b"]" * 100 + b"}",  # an escaped backslash ends
])
def test_deep_nesting_is_found_in_any_encoding(raw: bytes) -> None:
    assert json_bounds_error(raw) == f"the JSON nests deeper than {MAX_JSON_DEPTH} levels"


@pytest.mark.parametrize("raw", [
    b'{"a": "' + b"[" * 1000 + b'"}',  # brackets inside a string are text
    b'{"a": "\\"' + b"[" * 1000 + b'"}',  # ... after an escaped quote too
    b'{"a": "' + b"[" * 1000,  # unterminated: the parser refuses it without recursing
])
def test_brackets_inside_strings_do_not_count(raw: bytes) -> None:
    assert json_bounds_error(raw) is None


def test_what_passes_parses_without_recursion_errors() -> None:
    """Whatever the guard lets through, json.loads answers with a value or a ValueError."""
    for raw in (b"[" * 64 + b"]" * 64, b'["' + b"[" * 5000 + b'"]', b"[" * 64):
        assert json_bounds_error(raw) is None
        try:
            json.loads(raw)
        except ValueError:
            pass


def test_too_many_values() -> None:
    assert json_bounds_error(b"[" + b"0," * 100 + b"0]", max_values=50) == (
        "the JSON holds more than 50 values")
    assert json_bounds_error(b'["' + b"," * 100 + b'"]', max_values=50) is None
