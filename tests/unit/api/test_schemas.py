"""Request parsing, what is refused as unsupported, and the body a worker receives."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from api.capabilities import check_model, check_supported
from api.errors import InvalidRequest, NotFound
from api.schemas import ChatCompletionRequest, CompletionRequest, JobCreate
from api.submission import request_hash

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_body_is_normalised_for_the_worker() -> None:
    """Text parts are joined, stop becomes a list, max_completion_tokens is max_tokens."""
    request = ChatCompletionRequest.model_validate({
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
        ],
        "stop": "END",
        "max_completion_tokens": 7,
        "logprobs": True,
        "seed": 3,
    })
    check_supported(request)
    assert request.kind == "chat.completion"
    assert request.inference_body() == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "a\nb"}],
        "stop": ["END"],
        "max_tokens": 7,
        "seed": 3,
        "logprobs": True,
    }


def test_text_job_with_logprobs_zero_asks_for_sampled_token_logprobs() -> None:
    """A text request's logprobs=0 means the sampled token's log-probability."""
    request = JobCreate.model_validate({"model": "m", "prompt": "Once", "logprobs": 0,
                                        "top_k": 5, "ignore_eos": True, "priority": "low"})
    check_supported(request)
    assert request.kind == "text_completion"
    assert request.inference_body() == {"model": "m", "prompt": "Once", "top_k": 5,
                                        "ignore_eos": True, "logprobs": True}


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 2.5), ("top_p", 0), ("stop", ["a", "b", "c", "d", "e"]), ("stop", [""]),
    ("max_tokens", 0), ("n", 0), ("priority", "urgent"), ("callback_url", "ftp://x/y"),
    ("metadata", {f"k{i}": "v" for i in range(17)}), ("metadata", {"k": 1}), ("top_k", 0),
    ("unknown_field", 1), ("prompt", ["a", "b"]),
])
def test_shape_errors_name_the_field(field: str, value: object) -> None:
    """Out-of-range, mistyped and unknown fields fail validation at that field."""
    with pytest.raises(ValidationError) as info:
        JobCreate.model_validate({**CHAT, field: value})
    assert info.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize(("body", "param"), [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"chunk_size": 4}}, "stream_options.chunk_size"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"n": 129}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tools[1].function.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {  # ignored by the grammar
        "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {  # over OpenAI's limits
        "name": "x", "schema": {"enum": list(range(1001))}}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 101.0}}, "logit_bias"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
])
def test_unsupported_features_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    """Valid OpenAI requests this engine cannot serve get a 400 naming the field."""
    request = ChatCompletionRequest.model_validate({**CHAT, **body})
    with pytest.raises(InvalidRequest) as info:
        check_supported(request)
    assert info.value.param == param
    assert info.value.status_code == 400


def test_stream_is_accepted_where_it_is_relayed_and_refused_on_jobs() -> None:
    """The completions endpoints stream; a job is followed with GET /v1/jobs/{id}/events."""
    streamed = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    check_supported(ChatCompletionRequest.model_validate(streamed))
    assert ChatCompletionRequest.model_validate(streamed).inference_body()["stream"] is True
    with pytest.raises(InvalidRequest) as info:
        check_supported(JobCreate.model_validate({**CHAT, "stream": True}))
    assert info.value.param == "stream"


def test_structured_output_fields_are_accepted() -> None:
    """Schemas xgrammar compiles, tools with every tool_choice, penalties and biases pass."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]
    for extra in (
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "object", "properties": {
                "a": {"enum": ["p", "q"]}, "b": {"type": "array", "items": {"type": "number"}}},
                "required": ["a"]}}}},
        {"tools": tools}, {"tools": tools, "tool_choice": "required"},
        {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"5": -100}},
    ):
        check_supported(ChatCompletionRequest.model_validate({**CHAT, **extra}))


def test_defaults_clients_send_are_accepted() -> None:
    """Zero penalties, n=1, stream=false, empty tool fields and `store` pass."""
    request = ChatCompletionRequest.model_validate({
        **CHAT, "n": 1, "stream": False, "presence_penalty": 0, "frequency_penalty": 0,
        "tools": [], "tool_choice": "none", "logit_bias": {}, "top_logprobs": 0,
        "response_format": {"type": "text"}, "parallel_tool_calls": True, "store": True,
    })
    check_supported(request)


def test_completion_extras_are_refused() -> None:
    """suffix, best_of > 1 and a streamed echo are not supported (echo itself is)."""
    for extra, param in (({"echo": True, "stream": True}, "echo"), ({"suffix": "x"}, "suffix"),
                         ({"best_of": 2}, "best_of")):
        request = CompletionRequest.model_validate({"model": "m", "prompt": "p", **extra})
        with pytest.raises(InvalidRequest) as info:
            check_supported(request)  # a CompletionRequest may stream
        assert info.value.param == param
    check_supported(CompletionRequest.model_validate({"model": "m", "prompt": "p",
                                                      "echo": True}))


def test_job_needs_exactly_one_of_messages_or_prompt() -> None:
    """Neither or both is a 400 naming messages."""
    for body in ({"model": "m"}, {**CHAT, "prompt": "p"}):
        with pytest.raises(InvalidRequest) as info:
            check_supported(JobCreate.model_validate(body))
        assert info.value.param == "messages"


def test_unknown_model_is_404_model_not_found() -> None:
    """As OpenAI answers: 404, code model_not_found, param model."""
    check_model("a", ["a", "b"])
    with pytest.raises(NotFound) as info:
        check_model("gpt-4", ["a"])
    assert (info.value.param, info.value.code) == ("model", "model_not_found")


def test_request_hash_ignores_key_order_and_nulls() -> None:
    """The same request written differently hashes the same; a changed value does not."""
    a = JobCreate.model_validate({"model": "m", "prompt": "p", "temperature": 0})
    b = JobCreate.model_validate({"temperature": 0, "prompt": "p", "model": "m", "seed": None})
    c = JobCreate.model_validate({"model": "m", "prompt": "p", "temperature": 1})
    assert request_hash(a) == request_hash(b)
    assert request_hash(a) != request_hash(c)


TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    # As the official client sends back the message an answer carried.
    {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
]


def test_tool_calls_and_results_reach_the_worker() -> None:
    """An assistant's calls (content null) and the tool's result, as OpenAI takes them."""
    for model in (ChatCompletionRequest, JobCreate):
        request = model.model_validate({"model": "m", "messages": TOOL_TURNS})
        check_supported(request)
        assert request.inference_body()["messages"] == [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": "22C", "tool_call_id": "call_1"},
        ]


@pytest.mark.parametrize(("message", "problem"), [
    ({"role": "tool", "content": "22C"}, "needs the 'tool_call_id'"),
    ({"role": "user", "content": "x", "tool_call_id": "call_1"}, "needs the 'tool_call_id'"),
    ({"role": "user", "content": None}, "'content' is required"),
    ({"role": "user", "content": "x", "tool_calls": TOOL_TURNS[1]["tool_calls"]},
     "only an assistant message has 'tool_calls'"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "at least 1 item"),
])
def test_tool_fields_are_held_to_their_roles(message: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [message]})


def test_a_tool_result_must_answer_an_earlier_call() -> None:
    """OpenAI's rule: a `tool` message answers a call of an assistant message before it."""
    orphan = [TOOL_TURNS[0], {"role": "tool", "tool_call_id": "call_9", "content": "22C"}]
    backwards = [TOOL_TURNS[0], TOOL_TURNS[2], TOOL_TURNS[1]]
    for messages in (orphan, backwards):
        with pytest.raises(InvalidRequest) as info:
            check_supported(ChatCompletionRequest.model_validate({"model": "m",
                                                                  "messages": messages}))
        assert info.value.param == "messages[1].tool_call_id"
        assert "must answer a tool call" in info.value.message


def test_a_function_without_parameters_takes_none() -> None:
    """As OpenAI reads it: a forced call's arguments can only be `{}`."""
    import jsonschema

    from core.structured_outputs import tool_call_schema

    tools = [{"type": "function", "function": {"name": "ping"}}]
    schema = tool_call_schema(tools, {"type": "function", "function": {"name": "ping"}})
    assert schema is not None
    jsonschema.validate({"name": "ping", "arguments": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "ping", "arguments": {"host": "x"}}, schema)


def test_alternatives_per_position_reach_the_worker() -> None:
    """Chat's top_logprobs (with logprobs), a text request's logprobs count, on jobs too."""
    chat = ChatCompletionRequest.model_validate({**CHAT, "logprobs": True, "top_logprobs": 4})
    check_supported(chat)
    assert chat.inference_body()["top_logprobs"] == 4
    text = CompletionRequest.model_validate({"model": "m", "prompt": "p", "logprobs": 3})
    check_supported(text)
    assert (text.inference_body()["logprobs"], text.inference_body()["top_logprobs"]) == (True, 3)
    job = JobCreate.model_validate({"model": "m", "prompt": "p", "logprobs": 2})
    check_supported(job)
    assert job.inference_body()["top_logprobs"] == 2
    for body in ({**CHAT, "logprobs": 2}, {"model": "m", "prompt": "p", "logprobs": 6}):
        with pytest.raises(InvalidRequest) as info:
            check_supported(JobCreate.model_validate(body))
        assert info.value.param == "logprobs"


@pytest.mark.parametrize(("prompt", "sent"), [
    ("Once", "Once"), (["Once"], "Once"), ([5, 6, 7], [5, 6, 7]), ([[5, 6, 7]], [5, 6, 7]),
])
def test_a_prompt_in_any_of_openais_forms_reaches_the_worker(prompt: Any, sent: Any) -> None:
    """Text or token ids, alone or as a one-element list."""
    for model in (CompletionRequest, JobCreate):
        request = model.model_validate({"model": "m", "prompt": prompt})
        check_supported(request)
        assert request.inference_body()["prompt"] == sent


@pytest.mark.parametrize(("prompt", "problem"), [
    (["a", "b"], "holds 2 prompts; send one per request"),
    ([[1], [2]], "holds 2 prompts"),
    ([], "valid string"),
    ([1.5], "valid integer"),
    ([-1], "greater than or equal to 0"),
    ([[]], "at least 1 item"),
])
def test_prompts_a_job_cannot_be_are_refused_at_the_field(prompt: Any, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    assert info.value.errors()[0]["loc"][0] == "prompt"
