"""An engine server's SSE chunks joined into the text so far and the whole answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workers.inference.remote_stream import (
    StreamAssembler,
    StreamError,
    is_streamable,
    streamed,
)


def _data(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}"


def _chat_chunk(content: str | None = None, finish_reason: str | None = None,
                role: str | None = None) -> str:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return _data({"id": "x", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]})


def test_chat_chunks_join_to_the_answer_a_whole_request_gets() -> None:
    """vLLM's order: the role first, text deltas, the finish, the usage, [DONE]; blank
    lines and keep-alive comments between."""
    assembler = StreamAssembler(is_chat=True)
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    lines = [_chat_chunk("", role="assistant"), "", ": keep-alive", _chat_chunk("Hel"), "",
             _chat_chunk("lo!"), _chat_chunk(finish_reason="length"),
             _data({"choices": [], "usage": usage}), "data: [DONE]"]
    added = [assembler.feed_line(line) for line in lines]
    assert [a for a in added if a] == ["Hel", "lo!"]
    assert assembler.is_done and assembler.text == "Hello!"
    assert assembler.answer() == {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!",
                                             "refusal": None},
                     "finish_reason": "length", "logprobs": None}],
        "usage": usage}


def test_text_chunks_and_an_answer_without_usage() -> None:
    assembler = StreamAssembler(is_chat=False)
    for line in (_data({"choices": [{"index": 0, "text": " upon", "finish_reason": None}]}),
                 _data({"choices": [{"index": 0, "text": " a", "finish_reason": "stop"}]})):
        assembler.feed_line(line)
    assert assembler.answer() == {"choices": [{"index": 0, "text": " upon a",
                                               "finish_reason": "stop", "logprobs": None}]}


@pytest.mark.parametrize(("line", "said"), [
    (_data({"error": {"message": "out of memory", "code": 500}}), "out of memory"),
    (_data({"error": "overloaded"}), "overloaded"),
    ("data: {not json", "not JSON"),
    ("data: [1, 2]", "not an object"),
])
def test_an_error_event_or_a_broken_chunk_ends_the_stream(line: str, said: str) -> None:
    with pytest.raises(StreamError, match=said):
        StreamAssembler(is_chat=True).feed_line(line)


@pytest.mark.parametrize(("payload", "expected"), [
    ({"messages": []}, True),
    ({"messages": [], "n": 1}, True),
    ({"messages": [], "n": 2}, False),
    ({"messages": [], "tools": [{"type": "function"}]}, False),
    ({"prompt": "x", "logprobs": 0}, False),  # the sampled token's, no alternatives
    ({"messages": [], "logprobs": True}, False),
])
def test_what_is_asked_as_a_stream(payload: dict[str, Any], expected: bool) -> None:
    assert is_streamable(payload) is expected


def test_a_streamed_request_asks_for_the_usage_at_the_end() -> None:
    assert streamed({"model": "m", "max_tokens": 3}) == {
        "model": "m", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}}
