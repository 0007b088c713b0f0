"""Request fields an OpenAI or vLLM client sends, through the real service (the API on
uvicorn, a worker on the tiny model, the broker, Redis and PostgreSQL) with the official
`openai` client: `service_tier` picks the queue priority; `chat_template_kwargs` reach
the chat template on a call and a job alike; `echo` with logprobs (lm-eval-harness's
loglikelihood request) shows the prompt and its logprobs. (The `api` fixture:
tests/integration/conftest.py.)"""

from __future__ import annotations

from typing import Any, cast

import openai
import pytest
from openai import Stream
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from tests.utils.openai_api import OFF, Api


def test_openai_and_vllm_request_fields_do_what_they_say(api: Api) -> None:
    """One worker for the three checks."""
    api.service.start_worker()
    client = api.openai()
    _check_service_tier(api, client)
    _check_template_kwargs(api, client)
    _check_echo(api, client)


def _check_service_tier(api: Api, client: openai.OpenAI) -> None:
    """`service_tier` from the official client: `flex` queues low, `priority` high, on a
    sync call, a streamed one and a Responses call."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    raw = client.chat.completions.with_raw_response.create(
        model=api.model, messages=messages, max_tokens=2, service_tier="flex", extra_body=OFF)
    assert raw.parse().choices[0].message.content is not None
    assert api.job(raw.headers["x-job-id"])["priority"] == "low"
    streamed = client.chat.completions.with_raw_response.create(
        model=api.model, messages=messages, max_tokens=2, service_tier="flex", stream=True,
        extra_body=OFF)
    assert list(cast(Stream[ChatCompletionChunk], streamed.parse()))
    assert api.job(streamed.headers["x-job-id"])["priority"] == "low"
    response = client.responses.with_raw_response.create(
        model=api.model, input="Hi", max_output_tokens=4, service_tier="priority")
    assert response.parse().status in ("completed", "incomplete")  # 4 tokens may cut it
    assert api.job(response.headers["x-job-id"])["priority"] == "high"


def _check_template_kwargs(api: Api, client: openai.OpenAI) -> None:
    """vLLM's `chat_template_kwargs` (the tiny template closes an empty thinking block on
    `enable_thinking: false`, as Qwen3's does): a longer prompt, on a sync call and on a
    job alike, and not the plain call's cached answer."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Think?"}]
    asked: dict[str, Any] = {"model": api.model, "messages": messages, "max_tokens": 3,
                             "temperature": 0}
    plain = client.chat.completions.create(**asked)
    raw = client.chat.completions.with_raw_response.create(
        **asked, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    closed = raw.parse()
    assert plain.usage is not None and closed.usage is not None
    assert closed.usage.prompt_tokens > plain.usage.prompt_tokens
    assert api.job(raw.headers["x-job-id"])["cached"] is None
    view = api.run_job({**asked, "chat_template_kwargs": {"enable_thinking": False}, **OFF})
    assert view["result"]["usage"]["prompt_tokens"] == closed.usage.prompt_tokens
    assert view["result"]["choices"][0]["message"]["content"] == closed.choices[0].message.content


def _check_echo(api: Api, client: openai.OpenAI) -> None:
    """`echo` with `logprobs` and one token, as lm-eval-harness scores a continuation: the
    text starts with the prompt, and the logprobs cover every prompt token (the first
    null) and then the output's, whose own equals the same request's without echo."""
    asked: dict[str, Any] = {"model": api.model, "max_tokens": 1, "temperature": 0,
                             "logprobs": 1, "extra_body": OFF}
    for prompt in ("The quick brown fox", [17, 33, 120, 64, 9, 250]):
        plain = client.completions.create(prompt=prompt, **asked)
        echoed = client.completions.create(prompt=prompt, echo=True, **asked)
        [choice], [alone] = echoed.choices, plain.choices
        assert echoed.usage is not None and alone.logprobs is not None
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert lp.top_logprobs is not None and lp.text_offset is not None
        assert len(lp.tokens) == echoed.usage.prompt_tokens + 1
        assert choice.text == "".join(lp.tokens)
        assert choice.text.endswith(alone.text) and len(choice.text) > len(alone.text)
        if isinstance(prompt, str):
            assert choice.text == prompt + alone.text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
        assert all(t is not None and len(t) == 1 for t in lp.top_logprobs[1:])
        assert lp.token_logprobs[-1] == pytest.approx(alone.logprobs.token_logprobs[0],
                                                      abs=1e-5)
        job = api.run_job({"model": api.model, "prompt": prompt, "echo": True,
                           "max_tokens": 1, "temperature": 0, "logprobs": 1, **OFF})
        assert job["result"]["choices"][0]["text"] == choice.text
        assert job["result"]["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            lp.token_logprobs, abs=1e-5)
