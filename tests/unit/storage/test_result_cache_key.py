"""Result cache keys: only deterministic requests get one; equivalent bodies share it."""

from __future__ import annotations

from typing import Any

import pytest

from storage.result_cache import canonical_request, is_deterministic, result_cache_key

MODEL = "smollm2-135m-instruct"
CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}


@pytest.mark.parametrize(
    "extra,expected",
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.0}, True),
        ({"temperature": 1e-8}, True),  # greedy in the engine too
        ({"temperature": 1e-5}, False),
        ({"temperature": 0.7, "seed": 42}, True),
        ({"seed": 0}, True),
        ({}, False),
        ({"temperature": 0.7}, False),
        ({"temperature": 1, "seed": None}, False),
        ({"temperature": 1, "seed": True}, False),
        ({"temperature": False}, False),
    ],
)
def test_only_deterministic_requests_are_cacheable(extra: dict[str, Any], expected: bool) -> None:
    body = {**CHAT, **extra}
    assert is_deterministic(body) is expected
    key = result_cache_key(MODEL, body)
    assert (key is not None) is expected
    if key is not None:
        assert len(key) == 64 and int(key, 16) >= 0


def key(**changes: Any) -> str | None:
    """The key of CHAT at temperature 0 with some fields changed."""
    return result_cache_key(MODEL, {**CHAT, "temperature": 0, **changes})


def test_equivalent_bodies_share_a_key() -> None:
    base = key()
    # Field order, number spelling, defaults, and non-sampling fields do not matter.
    assert result_cache_key(MODEL, {"temperature": 0.0, **dict(reversed(CHAT.items()))}) == base
    assert key(priority="high", metadata={"a": 1}, callback_url="https://x", user="u") == base
    assert key(stream=False, cache_key="k", model="ignored-in-body") == base
    assert key(n=1, logprobs=False, top_p=1.0, presence_penalty=0.0, stop=None) == base
    assert key(stop=[]) == base
    # Greedy decoding ignores the sampling knobs; a temperature the engine decodes
    # greedily is 0.
    assert key(top_p=0.5, top_k=5, seed=7) == base
    assert key(temperature=1e-9, top_p=0.5) == base
    # max_completion_tokens is the newer name of max_tokens.
    renamed = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    renamed.update(max_completion_tokens=8, temperature=0)
    assert result_cache_key(MODEL, renamed) == base
    # A single stop string equals a one-element list; order of stop strings is irrelevant.
    assert key(stop="END") == key(stop=["END"])
    assert key(stop=["b", "a", "a"]) == key(stop=["a", "b"])


def test_output_shaping_changes_change_the_key() -> None:
    base = key()
    different = {
        key(max_tokens=9),
        key(stop=["x"]),
        key(logprobs=True),
        key(messages=[{"role": "user", "content": "Name a fruit."}]),
        result_cache_key("other-model", {**CHAT, "temperature": 0}),
        result_cache_key(MODEL, {**CHAT, "temperature": 0}, salt="ten_a"),
    }
    assert base not in different and len(different) == 6
    # With sampling, the seed and the knobs matter.
    sampled = {
        key(temperature=0.7, seed=1),
        key(temperature=0.7, seed=2),
        key(temperature=0.7, seed=1, top_p=0.5),
        key(temperature=0.8, seed=1),
    }
    assert len(sampled) == 4


def test_text_and_chat_requests_never_collide() -> None:
    chat = result_cache_key(MODEL, {"messages": [{"role": "user", "content": "hi"}], "seed": 1})
    text = result_cache_key(MODEL, {"prompt": "hi", "seed": 1})
    assert chat != text


def test_canonical_request_is_the_documented_form() -> None:
    one = {
        "temperature": 0.0,
        "stop": "END",
        "top_p": 0.9,
        "priority": "low",
        "max_completion_tokens": 8,
    }
    two = {"temperature": 0, "stop": ["END"], "max_tokens": 8, "metadata": {"run": 2}}
    expected = {"max_tokens": 8, "stop": ["END"], "temperature": 0}
    assert canonical_request(one) == expected
    assert canonical_request(two) == expected
    # Nested None and integral floats are normalised inside messages too.
    nested = {"messages": [{"role": "user", "content": "x", "name": None}], "x": [1.0, 2.5]}
    assert canonical_request(nested) == {
        "messages": [{"role": "user", "content": "x"}],
        "x": [1, 2.5],
    }
