"""Job body → prompt and SamplingParams, and the errors that fail one job."""

from __future__ import annotations

from typing import Any

import pytest

from workers.inference.sampling import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    prompt_from_body,
    sampling_params_from_body,
)

CHAT = "chat.completion"
TEXT = "text_completion"


def test_openai_fields_map_onto_sampling_params() -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "seed": 42,
        "stop": ["\n", "END"],
        "logprobs": True,
        "top_k": 20,
        "ignore_eos": True,
    }
    params = sampling_params_from_body(TEXT, body)
    assert params.max_tokens == 7
    assert params.temperature == 0.0 and params.is_greedy
    assert params.top_p == 0.5
    assert params.seed == 42
    assert params.stop == ["\n", "END"]
    assert params.logprobs is True
    assert params.top_k == 20
    assert params.ignore_eos is True


def test_defaults_follow_openai() -> None:
    params = sampling_params_from_body(TEXT, {"prompt": "x"})
    assert params.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS
    assert params.temperature == 1.0 and params.top_p == 1.0
    assert params.stop == [] and not params.logprobs and not params.ignore_eos
    chat = sampling_params_from_body(CHAT, {"messages": []}, max_model_len=2048)
    assert chat.max_tokens == 2048


def test_max_completion_tokens_and_single_stop_string() -> None:
    params = sampling_params_from_body(CHAT, {"max_completion_tokens": 5, "stop": "###"})
    assert params.max_tokens == 5
    assert params.stop == ["###"]


def test_text_logprobs_zero_means_sampled_token() -> None:
    assert sampling_params_from_body(TEXT, {"logprobs": 0}).logprobs is True
    assert sampling_params_from_body(TEXT, {"logprobs": False}).logprobs is False


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"seed": "abc"}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"n": 129}, "n"),
        ({"n": True}, "n"),
    ],
)
def test_bad_fields_raise_value_error_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        sampling_params_from_body(TEXT, body)


def test_prompt_kinds() -> None:
    messages = [{"role": "user", "content": "hello"}]
    assert prompt_from_body(CHAT, {"messages": messages}) == messages
    assert prompt_from_body(TEXT, {"prompt": "once upon"}) == "once upon"
    assert prompt_from_body(TEXT, {"prompt": [1, 2, 3]}) == [1, 2, 3]


@pytest.mark.parametrize(
    ("kind", "body", "field"),
    [
        (CHAT, {}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"content": "x"}]}, r"messages\[0\]"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, r"messages\[0\].content"),
        (TEXT, {}, "prompt"),
        (TEXT, {"prompt": ""}, "prompt"),
        (TEXT, {"prompt": ["a", "b"]}, "prompt"),
        (TEXT, {"prompt": [1, True]}, "prompt"),
    ],
)
def test_bad_prompts_raise_value_error(kind: str, body: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        prompt_from_body(kind, body)


@pytest.mark.parametrize(("body", "expected"), [
    ({"logprobs": True, "top_logprobs": 5}, (True, 5)),
    ({"logprobs": 3}, (True, 3)),  # a text completion's count of alternatives
    ({"logprobs": 0}, (True, 0)),
    ({"logprobs": True}, (True, 0)),
    ({}, (False, 0)),
])
def test_alternatives_per_position_reach_sampling_params(
        body: dict[str, Any], expected: tuple[bool, int]) -> None:
    params = sampling_params_from_body(TEXT, body)
    assert (params.logprobs, params.top_logprobs) == expected
