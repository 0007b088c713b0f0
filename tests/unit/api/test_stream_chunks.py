"""OpenAI's streaming chunk shapes, the SSE framing, and joining token entries by offset."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from api.stream_chunks import DONE, ChunkMaker, error_event, named_sse, result_text, sse
from api.token_relay import _Text
from api.tool_call_stream import ToolTextGate
from storage.token_streams import StreamEntry


def data_of(event: bytes) -> dict:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert b"\n" not in event[:-2], "an SSE data line must not break"
    return json.loads(event[6:])


def test_chat_chunks_start_with_the_role_and_end_with_the_finish_reason() -> None:
    chunks = ChunkMaker(kind="chat.completion", job_id="job_1", model="m", created=7)
    first, text, last = chunks.first(), chunks.text("Hel\nlo"), chunks.finish("length")
    assert first is not None
    for chunk in (first, text, last):
        parsed = ChatCompletionChunk.model_validate(data_of(sse(chunk)))
        assert parsed.id == "chatcmpl-job_1" and parsed.object == "chat.completion.chunk"
        assert parsed.created == 7 and parsed.model == "m"
        assert "usage" not in chunk
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert text["choices"][0]["delta"] == {"content": "Hel\nlo"}
    assert text["choices"][0]["finish_reason"] is None
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                  "finish_reason": "length"}


def test_include_usage_puts_null_usage_on_each_chunk_and_a_last_usage_chunk() -> None:
    chunks = ChunkMaker(kind="chat.completion", job_id="j", model="m", created=1,
                        include_usage=True)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert chunks.text("x")["usage"] is None
    assert chunks.finish("stop")["usage"] is None
    tail = ChatCompletionChunk.model_validate(chunks.usage(usage))
    assert tail.choices == [] and tail.usage is not None and tail.usage.total_tokens == 5


def test_text_completion_chunks_carry_text_and_no_role() -> None:
    chunks = ChunkMaker(kind="text_completion", job_id="j", model="m", created=1)
    assert chunks.first() is None
    chunk = chunks.text("abc")
    # OpenAI's own text chunks say `finish_reason: null` until the last, which its
    # client's (stricter) Completion type only accepts there.
    assert chunk["id"] == "cmpl-j" and chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "text": "abc", "logprobs": None,
                                 "finish_reason": None}]
    Completion.model_validate(chunks.finish("stop"))
    assert chunks.finish("stop")["choices"][0] == {"index": 0, "text": "", "logprobs": None,
                                                   "finish_reason": "stop"}


def test_sse_framing_done_named_events_and_errors() -> None:
    assert DONE == b"data: [DONE]\n\n"
    assert named_sse("token", {"text": "a"}) == b'event: token\ndata: {"text":"a"}\n\n'
    error = data_of(error_event({"message": "boom", "type": "server_error", "code": "x"}))
    assert error == {"error": {"message": "boom", "type": "server_error", "param": None,
                               "code": "x"}}


def test_result_text_reads_chat_and_text_results() -> None:
    assert result_text({"choices": [{"message": {"content": "hi"}}]}) == "hi"
    assert result_text({"choices": [{"text": "yo"}]}) == "yo"
    assert result_text({"choices": []}) == ""
    response = {"object": "response", "output": [{"type": "message", "content": [
        {"type": "output_text", "text": "a"}, {"type": "output_text", "text": "b"}]}]}
    assert result_text(response) == "ab"


def entry(offset: int, text: str) -> StreamEntry:
    return StreamEntry("j", offset=offset, text=text)


def test_entries_join_without_repeats_and_the_result_fills_a_gap() -> None:
    text = _Text()
    assert text.add(StreamEntry("j", event="started")) == ""
    assert text.add(entry(0, "Hello")) == "Hello"
    assert text.add(entry(0, "Hello")) == ""  # read twice (a re-read): nothing new
    assert text.add(entry(3, "lo, w")) == ", w"  # overlaps what was sent
    assert text.rest_of("Hello, world") == "orld"
    assert text.add(entry(20, "lost")) == ""  # an entry went missing before this one
    assert text.has_gap and text.add(entry(24, "more")) == ""
    assert text.rest_of("Hello, world and more") == "orld and more"
    assert _Text().rest_of("cached whole") == "cached whole"


def test_a_stored_text_that_does_not_continue_the_relayed_one_adds_nothing() -> None:
    text = _Text()
    text.add(entry(0, "abc"))
    assert text.rest_of("xyz and more") == ""


def test_entries_round_trip_through_redis_fields() -> None:
    original = StreamEntry("j", offset=4, text="é\n", finish_reason="stop")
    fields = {k.encode(): str(v).encode() for k, v in original.fields().items()}
    assert StreamEntry.parse("j", fields) == original
    assert StreamEntry.parse("j", {b"e": b"started"}).event == "started"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CALL_TEXT = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
STORED_CALLS = [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{}"}}]


@pytest.mark.parametrize("step", [1, 2, 5, 13, len(CALL_TEXT)])
def test_auto_tools_stream_the_text_before_a_call_and_not_the_call(step: int) -> None:
    """However the text is split (the trigger too), content stops where the call opens."""
    gate = ToolTextGate(TOOLS, "auto")
    sent = "".join(gate.text(CALL_TEXT[i:i + step]) for i in range(0, len(CALL_TEXT), step))
    assert sent == "Let me look. "
    assert gate.rest({"content": None, "tool_calls": STORED_CALLS}) == ("", STORED_CALLS)


def test_auto_tools_that_called_nothing_stream_all_their_text() -> None:
    """A `<` that does not open the trigger is held only until the next text says so; the
    rest of the stored text follows at the end."""
    gate = ToolTextGate(TOOLS, "auto")
    assert gate.text("a <to") == "a "
    assert gate.text("p> b <") == "<top> b "
    assert gate.rest({"content": "a <top> b <"}) == ("<", [])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_calls_stream_no_content(choice: object) -> None:
    """The whole output is the calls; cut short (no calls), it goes out as content."""
    gate = ToolTextGate(TOOLS, choice)
    assert gate.text('[{"name": "get_weather", ') == ""
    assert gate.rest({"content": None, "tool_calls": STORED_CALLS}) == ("", STORED_CALLS)
    assert gate.rest({"content": '[{"name": "get_weather", '}) == (
        '[{"name": "get_weather", ', [])


def test_tool_choice_none_streams_everything() -> None:
    gate = ToolTextGate(TOOLS, "none")
    assert gate.text(CALL_TEXT) == CALL_TEXT


def test_calls_go_out_in_openais_streamed_shape() -> None:
    chunk = ChunkMaker(kind="chat.completion", job_id="j", model="m", created=1).calls(
        STORED_CALLS)
    assert chunk["choices"][0]["delta"] == {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{}"}}]}
    assert chunk["choices"][0]["finish_reason"] is None


def test_logprobs_chunks_add_no_text_and_parse_as_openais() -> None:
    """Logprobs come whole in a chunk of their own (api.stream_chunks), in the shapes the
    official client parses: chat `{"content": [...]}`, text `{"tokens", ...}`."""
    chat = ChunkMaker(kind="chat.completion", job_id="j", model="m", created=1)
    content = {"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                            "top_logprobs": []}], "refusal": None}
    parsed = ChatCompletionChunk.model_validate(data_of(sse(chat.logprobs(content, 1))))
    assert parsed.choices[0].index == 1 and parsed.choices[0].delta.content is None
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.content is not None
    assert parsed.choices[0].logprobs.content[0].logprob == -0.5
    assert parsed.choices[0].finish_reason is None
    text = ChunkMaker(kind="text_completion", job_id="j", model="m", created=1)
    lp = {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": None, "text_offset": [0]}
    assert text.logprobs(lp)["choices"] == [{"index": 0, "text": "", "logprobs": lp,
                                            "finish_reason": None}]
    assert text.text("b", 2, lp)["choices"][0]["logprobs"] == lp
