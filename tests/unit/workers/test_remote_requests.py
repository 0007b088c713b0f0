"""A job as an engine server's request, and the server's answer as the job's result."""

from __future__ import annotations

import time
from typing import Any

import pytest

from core.messages import JobMessage
from workers.inference.outcomes import created_at_of
from workers.inference.remote_requests import (
    RemoteOutput,
    build_remote_result,
    check_response,
    error_message,
    request_of,
)


def job(kind: str = "chat.completion", priority: str = "low", **body: Any) -> JobMessage:
    if kind in ("chat.completion", "response"):
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    else:
        body.setdefault("prompt", "Once")
    return JobMessage(job_id="job_1", tenant_id="t", priority=priority, model="served-name",
                      kind=kind, body=body)  # type: ignore[arg-type]


def test_chat_request_carries_only_what_the_job_set() -> None:
    path, payload = request_of(job(temperature=0, max_tokens=5, stop=["\n"], cache={"mode": "off"}),
                               model="org/Model", send_priority=False)
    assert path == "/chat/completions"
    assert payload == {"model": "org/Model", "messages": [{"role": "user", "content": "Hi"}],
                       "temperature": 0, "max_tokens": 5, "stop": ["\n"]}


def test_chat_template_variables_go_to_the_server() -> None:
    """vLLM and SGLang take `chat_template_kwargs` (Qwen3's enable_thinking) as we do."""
    _, payload = request_of(job(chat_template_kwargs={"enable_thinking": False}), model="m",
                            send_priority=False)
    assert payload["chat_template_kwargs"] == {"enable_thinking": False}


def test_chat_without_max_tokens_leaves_the_limit_to_the_server() -> None:
    _, payload = request_of(job(), model="m", send_priority=False)
    assert "max_tokens" not in payload


def test_text_request_with_logprobs_and_vllm_extras_and_priority() -> None:
    path, payload = request_of(job("text_completion", top_k=3, ignore_eos=True, logprobs=True),
                               model="m", send_priority=True)
    assert path == "/completions"
    assert payload == {"model": "m", "prompt": "Once", "top_k": 3, "ignore_eos": True,
                       "logprobs": 0, "priority": 2}


@pytest.mark.parametrize(("priority", "rank"), [("high", 0), ("normal", 1), ("low", 2)])
def test_priority_is_vllms_lower_runs_first(priority: str, rank: int) -> None:
    assert request_of(job(priority=priority), model="m", send_priority=True)[1]["priority"] == rank


def test_embedding_jobs_are_refused() -> None:
    message = JobMessage(job_id="j", tenant_id="t", priority="low", model="m", kind="embedding",
                         body={"input": "x"})
    with pytest.raises(ValueError, match="not 'embedding' jobs"):
        request_of(message, model="m", send_priority=False)


def test_result_has_our_ids_and_the_servers_text_usage_and_finish_reason() -> None:
    answer = {"id": "chatcmpl-theirs", "model": "org/Model", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Hello"},
         "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
                  "prompt_tokens_details": {"cached_tokens": 8}}}
    result = build_remote_result(job(), RemoteOutput("job_1", check_response(answer)),
                                 created=1700, system_fingerprint="fp")
    assert result == {
        "id": "chatcmpl-job_1", "object": "chat.completion", "created": 1700,
        "model": "served-name", "system_fingerprint": "fp",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello",
                                             "refusal": None},
                     "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
                  "prompt_tokens_details": {"cached_tokens": 8}}}


def test_text_result() -> None:
    answer = {"choices": [{"text": " upon", "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    output = RemoteOutput("job_1", check_response(answer))
    result = build_remote_result(job("text_completion"), output, created=1,
                                 system_fingerprint=None)
    assert result["object"] == "text_completion" and result["id"] == "cmpl-job_1"
    assert result["choices"][0]["text"] == " upon"
    assert result["usage"] == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    assert output.finish_reason == "stop" and output.num_output_tokens == 1


@pytest.mark.parametrize("answer", [[], {"choices": []}, {"object": "error"}, "text"])
def test_an_answer_without_a_choice_is_refused(answer: object) -> None:
    with pytest.raises(ValueError, match="engine server"):
        check_response(answer)


@pytest.mark.parametrize(("payload", "text", "said"), [
    ({"error": {"message": "max_tokens is too large", "type": "BadRequestError"}}, "",
     "max_tokens is too large"),  # OpenAI's shape, as vLLM answers
    ({"object": "error", "message": "bad prompt"}, "", "bad prompt"),  # vLLM's older shape
    ({"detail": "Field required"}, "", "Field required"),  # FastAPI
    ({"error": "Input validation error"}, "", "Input validation error"),  # TGI
    (None, "plain words\n", "plain words"),
])
def test_error_message_quotes_the_server(payload: object, text: str, said: str) -> None:
    assert error_message(400, payload, text) == (
        f"the engine server refused the request (400): {said}")


def test_n_choices_pass_to_the_server_and_all_come_back() -> None:
    _, payload = request_of(job(n=2, temperature=1), model="org/Model", send_priority=False)
    assert payload["n"] == 2
    answer = {"choices": [{"index": 0, "text": " a", "finish_reason": "stop"},
                          {"index": 1, "text": " b", "finish_reason": "length"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 3}}
    result = build_remote_result(job("text_completion", n=2),
                                 RemoteOutput("job_1", check_response(answer)), created=1,
                                 system_fingerprint=None)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in result["choices"]] == [
        (0, " a", "stop"), (1, " b", "length")]


SCHEMA = {"type": "json_schema", "json_schema": {
    "name": "pick", "strict": True,
    "schema": {"type": "object", "properties": {"pick": {"enum": ["a", "b"]}},
               "required": ["pick"], "additionalProperties": False}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_structured_output_tools_and_biases_go_to_the_server_as_sent() -> None:
    """A server asked without them would answer free text for a schema the client set."""
    _, payload = request_of(job(response_format=SCHEMA, tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False, logit_bias={"7": -100}),
                            model="m", send_priority=False)
    assert (payload["response_format"], payload["tools"], payload["tool_choice"],
            payload["parallel_tool_calls"], payload["logit_bias"]) == (
        SCHEMA, TOOLS, "required", False, {"7": -100})


def test_a_response_runs_as_its_chat_body_and_comes_back_as_a_response() -> None:
    """A /v1/responses job: the chat request it runs as, its answer as OpenAI's `response`
    object, `created_at` the job's creation."""
    message = job("response", max_tokens=5, response_format=SCHEMA,
                  metadata={"k": "v"}, instructions="Be brief.")
    path, payload = request_of(message, model="m", send_priority=False)
    assert path == "/chat/completions"
    assert payload["messages"] == [{"role": "user", "content": "Hi"}]
    assert (payload["max_tokens"], payload["response_format"]) == (5, SCHEMA)
    assert "metadata" not in payload and "instructions" not in payload
    answer = {"choices": [{"index": 0, "message": {"role": "assistant",
                                                   "content": '{"pick": "a"}'},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 9, "completion_tokens": 5}}
    result = build_remote_result(message, RemoteOutput("job_1", check_response(answer)),
                                 created=1700, system_fingerprint=None)
    from openai.types.responses import Response

    response = Response.model_validate(result)
    assert (response.id, response.object, response.status, response.created_at) == (
        "resp_job_1", "response", "completed", 1700)
    assert response.output_text == '{"pick": "a"}'
    assert (response.metadata, response.instructions) == ({"k": "v"}, "Be brief.")
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (9, 5)


def test_a_responses_created_at_is_its_jobs_creation_a_completions_created_is_now() -> None:
    """As the response read back while queued says; from before the field, the clock."""
    response = job("response").model_copy(update={"created_at": 1_700_000_000.9})
    assert created_at_of(response) == 1_700_000_000
    now = int(time.time())
    assert now <= created_at_of(job("response")) <= now + 1  # a message without the field
    chat = job().model_copy(update={"created_at": 1_700_000_000.9})
    assert now <= created_at_of(chat) <= now + 1
