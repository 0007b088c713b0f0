"""Result shaping: OpenAI chat.completion / text_completion objects with usage."""

from __future__ import annotations

import pytest

from workers.inference.results import (
    Completion,
    EchoedPrompt,
    build_result,
    error_body,
    param_of,
)


def completion(**overrides: object) -> Completion:
    values: dict[str, object] = {
        "text": "Paris.",
        "token_ids": [11, 12],
        "finish_reason": "stop",
        "num_prompt_tokens": 9,
        "num_cached_tokens": 4,
    }
    values.update(overrides)
    return Completion(**values)  # type: ignore[arg-type]


def test_chat_completion_shape() -> None:
    result = build_result(
        "chat.completion", job_id="job_1", model="m", completion=completion(), created=1700
    )
    assert result["object"] == "chat.completion"
    assert result["id"] == "chatcmpl-job_1"
    assert result["model"] == "m" and result["created"] == 1700
    (choice,) = result["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "Paris."
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None
    assert result["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 2,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_text_completion_shape_with_length_finish() -> None:
    result = build_result(
        "text_completion",
        job_id="job_2",
        model="m",
        completion=completion(text=" there", finish_reason="length"),
        created=1,
    )
    assert result["object"] == "text_completion"
    assert result["id"] == "cmpl-job_2"
    (choice,) = result["choices"]
    assert choice["text"] == " there"
    assert choice["finish_reason"] == "length"
    assert "message" not in choice


def test_logprobs_in_both_shapes() -> None:
    done = completion(text="ab", token_ids=[1, 2], logprobs=[-0.5, -1.25])
    text = {1: "a", 2: "b"}.__getitem__
    chat = build_result(
        "chat.completion", job_id="j", model="m", completion=done, created=0, token_text=text
    )
    assert chat["choices"][0]["logprobs"]["content"] == [
        {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []},
        {"token": "b", "logprob": -1.25, "bytes": [98], "top_logprobs": []},
    ]
    legacy = build_result(
        "text_completion", job_id="j", model="m", completion=done, created=0, token_text=text
    )
    assert legacy["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -1.25],
        "top_logprobs": None,
        "text_offset": [0, 1],
    }


def test_top_logprobs_in_both_shapes() -> None:
    """Chat: each position's alternatives as token objects; text: {token: logprob}."""
    done = completion(text="ab", token_ids=[1, 2], logprobs=[-0.5, -1.25])
    done.top_logprobs = [[(1, -0.5), (3, -1.0)], [(3, -0.25), (2, -1.25)]]
    text = {1: "a", 2: "b", 3: "c"}.__getitem__
    chat = build_result(
        "chat.completion", job_id="j", model="m", completion=done, created=0, token_text=text
    )
    assert chat["choices"][0]["logprobs"]["content"][1] == {
        "token": "b", "logprob": -1.25, "bytes": [98], "top_logprobs": [
            {"token": "c", "logprob": -0.25, "bytes": [99]},
            {"token": "b", "logprob": -1.25, "bytes": [98]}]}
    legacy = build_result(
        "text_completion", job_id="j", model="m", completion=done, created=0, token_text=text
    )
    assert legacy["choices"][0]["logprobs"]["top_logprobs"] == [
        {"a": -0.5, "c": -1.0}, {"c": -0.25, "b": -1.25}]


def test_echo_puts_the_prompt_before_the_output_and_its_logprobs_first() -> None:
    """`echo`: the text starts with the prompt; with logprobs the prompt's tokens come
    first, the first with no logprob and no alternatives (null), as OpenAI shows them."""
    text = {1: "a", 2: "b", 3: "c", 7: "x", 8: "y"}.__getitem__
    done = completion(text="ab", token_ids=[1, 2], logprobs=[-0.5, -1.25],
                      top_logprobs=[[(1, -0.5)], [(3, -0.25)]],
                      echo=EchoedPrompt("xy", [7, 8], [None, -2.0], [None, [(3, -1.5)]]))
    choice = build_result("text_completion", job_id="j", model="m", completion=done,
                          created=0, token_text=text)["choices"][0]
    assert choice["text"] == "xyab"
    assert choice["logprobs"] == {
        "tokens": ["x", "y", "a", "b"], "token_logprobs": [None, -2.0, -0.5, -1.25],
        "top_logprobs": [None, {"c": -1.5}, {"a": -0.5}, {"c": -0.25}],
        "text_offset": [0, 1, 2, 3]}
    # Without logprobs: the text alone.
    plain = completion(text="ab", echo=EchoedPrompt("xy", [7, 8]))
    choice = build_result("text_completion", job_id="j", model="m", completion=plain,
                          created=0, token_text=text)["choices"][0]
    assert choice["text"] == "xyab" and choice["logprobs"] is None


def test_aborted_or_unknown_kind_has_no_result() -> None:
    with pytest.raises(ValueError, match="finish_reason"):
        build_result(
            "chat.completion",
            job_id="j",
            model="m",
            completion=completion(finish_reason="abort"),
            created=0,
        )
    with pytest.raises(ValueError, match="kind"):
        build_result("embedding", job_id="j", model="m", completion=completion(), created=0)


def test_error_body_and_param() -> None:
    assert error_body("bad", param="top_p") == {
        "message": "bad",
        "type": "invalid_request_error",
        "param": "top_p",
        "code": None,
    }
    known = ("top_logprobs", "logprobs", "max_tokens", "prompt")
    assert param_of("top_logprobs is not supported; logprobs of ...", known) == "top_logprobs"
    assert param_of("prompt is 900 tokens, longer than max_model_len", known) == "prompt"
    assert param_of("something else", known) is None


def test_param_is_a_whole_field_name_never_a_letter_inside_a_word() -> None:
    """`n` is a request field, and the letter n is in nearly every message."""
    from workers.inference.outcomes import REQUEST_FIELDS

    assert param_of("engine stopped unexpectedly", REQUEST_FIELDS) is None
    assert param_of("the prompt is 900 tokens, longer than the context", REQUEST_FIELDS) == (
        "prompt")
    assert param_of("max_completion_tokens must be at least 1", REQUEST_FIELDS) == (
        "max_completion_tokens")
    assert param_of("n must be 1", REQUEST_FIELDS) == "n"
    assert param_of("stop strings: at most 4 (stop[4] is one too many)", REQUEST_FIELDS) == (
        "stop")


def test_n_choices_are_indexed_and_counted_once_for_the_prompt() -> None:
    others = [(completion(text="Lyon.", token_ids=[5, 6, 7], finish_reason="length"), None),
              (completion(text='{"a": 1}', token_ids=[8]),
               [{"id": "call_1", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}])]
    result = build_result("chat.completion", job_id="j", model="m", completion=completion(),
                          created=0, others=others)
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in result["choices"]] == ["Paris.", "Lyon.", None]
    assert [c["finish_reason"] for c in result["choices"]] == ["stop", "length", "tool_calls"]
    assert result["usage"]["prompt_tokens"] == 9
    assert result["usage"]["completion_tokens"] == 2 + 3 + 1
    assert result["usage"]["total_tokens"] == 9 + 6
    text = build_result("text_completion", job_id="j", model="m", completion=completion(),
                        created=0, others=others[:1])
    assert [c["text"] for c in text["choices"]] == ["Paris.", "Lyon."]
