"""A string over its length bound is refused in characters, naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from core.request_checks import RequestRefused, parse_body

USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(("extra", "param", "limit"), [
    ({"metadata": {"k": "v" * 513}}, "metadata.k", "at most 512 characters"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "at most 64 characters"),
    ({"user": "u" * 257}, "user", "at most 256 characters"),
    ({"messages": [USER | {"name": "n" * 65}]}, "messages[0].name", "at most 64 characters"),
    ({"messages": [USER, {"role": "tool", "content": "x", "tool_call_id": "c" * 257}]},
     "messages[1].tool_call_id", "at most 256 characters"),
])
def test_a_string_over_its_bound_is_refused_in_characters(extra: dict[str, Any], param: str,
                                                          limit: str) -> None:
    body = {"model": "m", "messages": [USER], **extra}
    with pytest.raises(RequestRefused) as refused:
        parse_body(body, is_chat=True)
    assert refused.value.param is not None and refused.value.param.startswith(param)
    assert limit in refused.value.message and "items" not in refused.value.message
