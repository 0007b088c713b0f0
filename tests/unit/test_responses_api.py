"""`/v1/responses` bodies: the subset accepted, its chat form, and the Responses object."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from openai.types.responses import Response

from core.request_checks import RequestRefused
from core.responses_api import (
    ECHOED_INSTRUCTIONS,
    as_responses_refusal,
    response_object,
    to_chat_body,
    with_request_echoed,
)
from scheduler.batch_input import iter_requests, validate_input
from workers.inference.results import Completion, build_result

RESPONSES = "/v1/responses"


def test_input_instructions_and_format_become_a_chat_body() -> None:
    """Text or message input, instructions first, max_output_tokens, text.format nested."""
    chat = to_chat_body({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0,
        "input": [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"role": "assistant", "content": "c"}],
        "text": {"format": {"type": "json_schema", "name": "x", "strict": True,
                            "schema": {"type": "object"}}}})
    assert chat == {
        "model": "m", "max_completion_tokens": 7, "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "object"}}}}
    assert to_chat_body({"model": "m", "input": "hi"})["messages"] == [
        {"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m"}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": [{"role": "user", "content": []}]}, "input[0].content"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://x"}]}]}, "input[0].content[0].type"),
    ({"model": "m", "input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema",
                                                      "schema": {"type": "object"}}}},
     "text.format.name"),
    ({"model": "m", "input": "x", "text": {"format": {  # a misspelt strict
        "type": "json_schema", "name": "x", "schema": {"type": "object"}, "strcit": True}}},
     "text.format.strcit"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_object",
                                                      "schema": {"type": "object"}}}},
     "text.format.schema"),
    ({"model": "m", "input": [{"role": "user", "content": 7}]}, "input[0].content"),
    ({"model": "m", "input": [{"role": "user", "content": None}]}, "input[0].content"),
    ({"model": "m", "input": [{"role": "user", "content": ["x"]}]}, "input[0].content[0]"),
    ({"model": "m", "input": "x", "stream": True}, "stream"),  # a batch line: nothing reads it
    ({"model": "m", "input": "x", "background": True}, "background"),
])
def test_what_the_engine_cannot_honour_is_refused_by_name(body: dict[str, Any], param: str
                                                         ) -> None:
    """Unknown fields and non-text parts name the field."""
    with pytest.raises(RequestRefused) as info:
        to_chat_body(body)
    assert info.value.param == param


def test_fields_sent_as_null_or_empty_count_as_not_sent() -> None:
    """What client libraries send for what they leave unset runs, as OpenAI runs it."""
    unset: dict[str, Any] = {
        "previous_response_id": None, "reasoning": None, "include": [], "tools": [],
        "tool_choice": None, "truncation": None, "temperature": None, "stream": False,
        "background": False}
    assert to_chat_body({"model": "m", "input": "x", **unset}) == to_chat_body(
        {"model": "m", "input": "x"})


def test_batch_lines_for_responses_validate_and_refuse_by_line() -> None:
    """A /v1/responses file: good lines become chat bodies; a bad schema fails its line."""
    def line(custom_id: str, **body: Any) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": RESPONSES,
                           "body": {"model": "tiny", "input": "hi", **body}})
    bad_format = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}
    raw = "\n".join([line("ok", max_output_tokens=3), line("bad", text=bad_format)]) + "\n"
    report = validate_input(io.BytesIO(raw.encode()), endpoint=RESPONSES,
                            served_models=["tiny"], max_requests=10, max_line_bytes=10_000)
    assert report.is_valid, report
    requests = list(iter_requests(io.BytesIO(raw.encode()), endpoint=RESPONSES,
                                  max_line_bytes=10_000, check_bodies=True))
    assert requests[0].error is None
    assert requests[0].body["messages"] == [{"role": "user", "content": "hi"}]
    assert requests[0].body["max_completion_tokens"] == 3
    # Named as the Responses body has it, though the line runs as a chat body.
    assert requests[1].error is not None and requests[1].error["param"] == "text.format"
    assert "response_format" not in requests[1].error["message"]


@pytest.mark.parametrize(("chat", "responses"), [
    ("max_completion_tokens", "max_output_tokens"),
    ("messages", "input"),
    ("messages[3].content", "input"),
    ("response_format", "text.format"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.type", "text.format.type"),
    ("response_format.json_schema.strict", "text.format.strict"),
    ("prompt", "input"),
    ("temperature", "temperature"),
])
def test_what_the_chat_checks_name_is_named_as_the_responses_api_names_it(
        chat: str, responses: str) -> None:
    refused = as_responses_refusal(RequestRefused(f"Invalid value for '{chat}': no.",
                                                  param=chat, code="invalid_value"))
    assert refused.param == responses
    assert refused.message == f"Invalid value for '{responses}': no."
    assert refused.code == "invalid_value" and refused.status_code == 400


def test_a_finished_job_is_answered_as_a_response_object() -> None:
    """output[0].content[0].text, usage in input/output tokens, incomplete when cut."""
    completion = Completion(text='{"a": 1}', token_ids=[1, 2, 3], finish_reason="stop",
                            num_prompt_tokens=5, num_cached_tokens=2)
    result = build_result("response", job_id="job_1", model="m", completion=completion,
                          created=9, body={"max_completion_tokens": 3})
    assert result["object"] == "response" and result["id"] == "resp_job_1"
    assert result["status"] == "completed" and result["created_at"] == 9
    assert result["output"][0]["content"][0] == {"type": "output_text", "text": '{"a": 1}',
                                                 "annotations": []}
    assert result["usage"]["input_tokens"] == 5 and result["usage"]["output_tokens"] == 3
    assert result["usage"]["input_tokens_details"] == {"cached_tokens": 2,
                                                       "cache_write_tokens": 0}
    Response.model_validate(result)  # the official client's type, field for field
    completion.finish_reason = "length"
    cut = response_object(build_result("chat.completion", job_id="j", model="m",
                                       completion=completion, created=9),
                          job_id="j", body={})
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_cached_response_echoes_the_request_it_now_answers() -> None:
    """Metadata, instructions, background and the sampling fields are the new request's;
    the output is the cached one's."""
    first = to_chat_body({"model": "m", "input": "x", "metadata": {"run": "1"},
                          "instructions": "Be brief.", "max_output_tokens": 4})
    first[ECHOED_INSTRUCTIONS] = "Be brief."
    chat = {"created": 7, "model": "m", "usage": {"prompt_tokens": 3, "completion_tokens": 2,
            "total_tokens": 5}, "choices": [{"index": 0, "finish_reason": "stop",
                                             "message": {"role": "assistant", "content": "y"}}]}
    cached = response_object(chat, job_id="job_1", body=first)
    second = {**first, "metadata": {"run": "2"}, "background": True, "instructions": "Hi."}
    echoed = with_request_echoed(cached, job_id="job_2", body=second)
    assert (echoed["metadata"], echoed["background"], echoed["instructions"]) == (
        {"run": "2"}, True, "Hi.")
    assert (cached["metadata"], cached["background"]) == ({"run": "1"}, False)
    assert echoed["output"] == cached["output"] and echoed["usage"] == cached["usage"]
    assert echoed["max_output_tokens"] == 4
