"""Streaming through the real service: the API on uvicorn, a worker on the tiny model, the
broker, Redis and PostgreSQL; requests from the official `openai` client and httpx.

What is checked: a streamed completion's chunks join to the text of the same request
without `stream`, in OpenAI's chunk shapes, and so do their logprobs (chat and text, every
choice); `include_usage` ends with the usage; a cached answer streams; a streamed
`/v1/responses` call's typed events join to the text of the same call without `stream`
(also through the client's accumulating `responses.stream`); a client that leaves
cancels its job; `GET /v1/jobs/{id}/events` follows a job from queued to finished, and
resumes after a client's `Last-Event-ID`. (The `api` fixture: tests/integration/conftest.py.)
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any, cast

import httpx
import openai
import pytest
from openai import Stream
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam
from openai.types.responses import Response, ResponseStreamEvent

from tests.utils.openai_api import OFF, Api

# A structured output the random model must finish (one of two words, then EOS).
PICK: dict[str, Any] = {"type": "object", "properties": {"pick": {"enum": ["yes", "no"]}},
                        "required": ["pick"], "additionalProperties": False}


def _started(api: Api) -> None:
    api.service.start_worker()


def test_streams_join_to_the_same_text_chunk_by_chunk(api: Api) -> None:
    """Chat with include_usage, text without it, and a cached answer: one worker for all
    (which also serves the n-choices and Responses checks, to start one service less)."""
    _started(api)
    client = api.openai()
    _check_chat(api, client)
    _check_text(api, client)
    _check_cached(api, client)
    _check_choices(api, client)
    _check_logprobs(api, client)
    _check_responses(api, client)


def _check_chat(api: Api, client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me a long story."}]
    whole = client.chat.completions.create(model=api.model, messages=messages,
                                           max_tokens=48, temperature=0, extra_body=OFF)
    stream = client.chat.completions.create(
        model=api.model, messages=messages, max_tokens=48, temperature=0,
        extra_body=OFF, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)

    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks if c.choices and
             c.choices[0].delta.content]
    assert len(texts) > 1, "the text came in one piece, not as the engine produced it"
    assert "".join(texts) == whole.choices[0].message.content
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    # include_usage: one last chunk without choices carries the usage.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def _check_text(api: Api, client: openai.OpenAI) -> None:
    whole = client.completions.create(model=api.model, prompt="Once upon a time",
                                      max_tokens=32, temperature=0, extra_body=OFF)
    chunks = list(client.completions.create(model=api.model, prompt="Once upon a time",
                                            max_tokens=32, temperature=0, extra_body=OFF,
                                            stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert len([c for c in chunks if c.choices[0].text]) > 1
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)


def _check_cached(api: Api, client: openai.OpenAI) -> None:
    """A deterministic request asked twice: the second, streamed, comes from the cache."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Cache me."}]
    first = client.chat.completions.create(model=api.model, messages=messages,
                                           max_tokens=16, temperature=0)
    raw = client.chat.completions.with_raw_response.create(
        model=api.model, messages=messages, max_tokens=16, temperature=0,
        stream=True)
    chunks = list(cast(Stream[ChatCompletionChunk], raw.parse()))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    assert api.job(raw.headers["x-job-id"])["cached"] == "exact"


def _check_choices(api: Api, client: openai.OpenAI) -> None:
    """`n` choices: a sync call, the same call streamed, a job; a seed makes them repeat."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Pick one."}]
    asked: dict[str, Any] = {"model": api.model, "messages": messages, "max_tokens": 8,
                             "temperature": 1.0, "seed": 3, "n": 3,
                             "extra_body": {**OFF, "ignore_eos": True}}
    whole = client.chat.completions.create(**asked)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1, "every choice drew the same tokens"
    assert whole.usage is not None and whole.usage.completion_tokens == 3 * 8
    again = client.chat.completions.create(**asked)
    assert [c.message.content for c in again.choices] == texts

    chunks = list(client.chat.completions.create(**asked, stream=True))
    streamed: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert [streamed[i] for i in range(3)] == texts
    assert finished == {0: "length", 1: "length", 2: "length"}

    view = api.run_job({"model": api.model, "prompt": "Count:", "n": 2, "max_tokens": 4,
                        "temperature": 0, **OFF})
    [first, second] = view["result"]["choices"]
    assert (first["index"], second["index"]) == (0, 1)
    assert first["text"] == second["text"]  # greedy: the same text twice


def _check_logprobs(api: Api, client: openai.OpenAI) -> None:
    """Logprobs with `stream`: the chunks' text and logprobs, joined per choice, are the
    result of the same request without it (the text as it comes, the logprobs whole)."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say more."}]
    asked: dict[str, Any] = {"model": api.model, "messages": messages, "max_tokens": 12,
                             "temperature": 1.0, "seed": 5, "n": 2, "logprobs": True,
                             "top_logprobs": 2, "extra_body": {**OFF, "ignore_eos": True}}
    whole = client.chat.completions.create(**asked)
    texts: dict[int, str] = {}
    content: dict[int, list[Any]] = {}
    for chunk in client.chat.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.logprobs is not None:
                content.setdefault(choice.index, []).extend(choice.logprobs.content or [])
    for choice in whole.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        assert len(choice.logprobs.content) == 12
        assert texts[choice.index] == choice.message.content
        assert content[choice.index] == choice.logprobs.content
        assert all(len(t.top_logprobs) == 2 for t in content[choice.index])

    text_asked: dict[str, Any] = {"model": api.model, "prompt": "Once upon a time",
                                  "max_tokens": 10, "temperature": 0, "logprobs": 1,
                                  "extra_body": OFF}
    text_whole = client.completions.create(**text_asked)
    chunks = list(client.completions.create(**text_asked, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text_whole.choices[0].text
    carrying = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert carrying == [text_whole.choices[0].logprobs]
    assert text_whole.choices[0].logprobs is not None
    assert len(text_whole.choices[0].logprobs.tokens or []) == 10


def _check_responses(api: Api, client: openai.OpenAI) -> None:
    """POST /v1/responses with the official client: the same text as the chat call it runs
    as; in the background, a job whose result is the same object; a stream is refused."""
    chat = client.chat.completions.create(
        model=api.model, max_tokens=8, temperature=0, extra_body=OFF,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    response = client.responses.create(model=api.model, instructions="Be brief.", input="Hi",
                                       max_output_tokens=8, temperature=0, extra_body=OFF,
                                       metadata={"run": "7"})
    assert response.object == "response" and response.output_text == chat.choices[0].message.content
    # Echoed, as OpenAI does.
    assert (response.metadata, response.instructions) == ({"run": "7"}, "Be brief.")
    read_back = client.responses.retrieve(response.id)
    assert (read_back.id, read_back.status, read_back.output_text, read_back.metadata) == (
        response.id, response.status, response.output_text, {"run": "7"})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_job_nope")
    assert response.usage is not None and chat.usage is not None
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                               else "completed")

    queued = client.responses.create(model=api.model, input="Hi", max_output_tokens=4,
                                     temperature=0, extra_body={"background": True})
    assert queued.status == "queued" and queued.output == []
    job_id = queued.id.removeprefix("resp_")  # GET /v1/jobs/{id} follows it too
    deadline = time.monotonic() + 120
    while (view := api.job(job_id))["status"] != "succeeded":
        assert view["status"] in ("queued", "running"), view
        assert time.monotonic() < deadline, view
        time.sleep(0.1)
    assert view["result"]["object"] == "response" and view["result"]["output"]
    assert view["result"]["created_at"] == queued.created_at  # as the worker stored it
    done = client.responses.retrieve(queued.id)
    assert done.status in ("completed", "incomplete")
    assert done.created_at == queued.created_at  # the same response, read later
    (item,) = client.responses.input_items.list(queued.id)
    assert (item.type, item.role, item.content[0].text) == (  # type: ignore[union-attr]
        "message", "user", "Hi")
    with pytest.raises(openai.ConflictError):
        client.responses.cancel(queued.id)  # finished: nothing left to cancel
    # The worker frozen, a response stays queued until cancelled (it cannot finish first).
    (worker,) = api.service.workers
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        long = client.responses.create(model=api.model, input="Go on and on", temperature=0,
                                       max_output_tokens=900, extra_body={"background": True})
        assert client.responses.cancel(long.id).status == "cancelled"
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert api.job(long.id.removeprefix("resp_"))["status"] == "cancelled"

    with pytest.raises(openai.BadRequestError) as image:
        image_part: Any = {"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"}]}
        client.responses.create(model=api.model, input=[image_part])
    assert image.value.param == "input[0].content[0].type"
    _check_responses_streamed(api, client, response)


def _check_responses_streamed(api: Api, client: openai.OpenAI, whole: Response) -> None:
    """The same Responses call streamed: typed events whose deltas join to its text; the
    stream helper's final response; a cached answer; fields refused as 400s."""
    asked: dict[str, Any] = {"model": api.model, "instructions": "Be brief.", "input": "Hi",
                             "max_output_tokens": 8, "temperature": 0}
    with client.responses.create(**asked, extra_body=OFF, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", last]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1, "the text came in one piece, not as the engine produced it"
    assert "".join(deltas) == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == last
    assert final.response.output_text == whole.output_text
    assert final.response.usage == whole.usage
    assert final.response.id == events[0].response.id  # type: ignore[union-attr]

    # The helper that accumulates events into a response; a schema whose language is
    # finite, so that even the random model completes (no max_output_tokens cut).
    text: Any = {"format": {"type": "json_schema", "name": "pick", "strict": True,
                            "schema": PICK}}
    formatted = client.responses.create(model=api.model, input="Pick.", text=text,
                                        temperature=0, max_output_tokens=40, extra_body=OFF)
    assert formatted.status == "completed", formatted
    with client.responses.stream(model=api.model, input="Pick.", text=text, temperature=0,
                                 max_output_tokens=40, extra_body=OFF) as helper:
        snapshots = [e.snapshot for e in helper if e.type == "response.output_text.delta"]
        accumulated = helper.get_final_response()
    assert accumulated.output_text == formatted.output_text == snapshots[-1]
    assert json.loads(accumulated.output_text)["pick"] in PICK["properties"]["pick"]["enum"]

    # Cached: the call above, asked again with the cache on, streams from the cache.
    client.responses.create(**asked)
    raw = client.responses.with_raw_response.create(**asked, stream=True)
    cached = list(cast(Stream[ResponseStreamEvent], raw.parse()))
    assert "".join(e.delta for e in cached if e.type == "response.output_text.delta") \
        == whole.output_text
    assert api.job(raw.headers["x-job-id"])["cached"] == "exact"
    # Answered from the cache, it echoes its own request, not the cached one's.
    echo = client.responses.create(**asked, metadata={"run": "8"},
                                   extra_body={"background": True})
    assert echo.background is True
    job_id = echo.id.removeprefix("resp_")
    deadline = time.monotonic() + 60
    while (view := api.job(job_id))["status"] != "succeeded":
        assert view["status"] in ("queued", "running") and time.monotonic() < deadline, view
        time.sleep(0.1)
    assert view["cached"] == "exact"
    echoed = client.responses.retrieve(echo.id)
    assert (echoed.metadata, echoed.background, echoed.output_text) == (
        {"run": "8"}, True, whole.output_text)

    # Refused before anything is queued: unsupported fields 400, malformed ones 400.
    for extra, status, param in (({"background": True}, 400, "background"),
                                 ({"stream_options": {"include_usage": True}}, 400,
                                  "stream_options.include_usage"),
                                 ({"max_output_tokens": 0}, 400, "max_output_tokens")):
        with pytest.raises(openai.APIStatusError) as refused:
            client.post("/responses", cast_to=object,
                        body={"model": api.model, "input": "Hi", "stream": True, **extra})
        assert (refused.value.status_code, refused.value.param) == (status, param)


def test_a_client_that_leaves_cancels_its_job(api: Api) -> None:
    """A streamed completion, then a streamed response: each hung up on mid-text."""
    _started(api)
    body = {"model": api.model, "prompt": "Go on and on", "max_tokens": 900,
            "ignore_eos": True, "temperature": 0, "stream": True, **OFF}
    with api.http() as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        job_id = response.headers["x-job-id"]
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # text is flowing: hang up
    assert _ended(api, job_id)["status"] == "cancelled"

    # Responses have no ignore_eos: greedy on this prompt runs long without EOS (were it
    # to stop before the hang-up lands, the job would show here as succeeded).
    body = {"model": api.model, "input": "Go on and on", "max_output_tokens": 900,
            "temperature": 0, "stream": True, **OFF}
    with api.http() as client, client.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200, response.read()
        job_id = response.headers["x-job-id"]
        for line in response.iter_lines():
            if line == "event: response.output_text.delta":
                break
    job = _ended(api, job_id)
    assert job["status"] == "cancelled", job


def _ended(api: Api, job_id: str) -> dict[str, Any]:
    """The job once it is over."""
    deadline = time.monotonic() + 60
    while (job := api.job(job_id))["status"] not in ("cancelled", "succeeded", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    return job


def _events(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs of an SSE response."""
    name = "message"
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])
            name = "message"


def test_job_events_follow_a_job_from_queued_to_finished(api: Api) -> None:
    body = {"model": api.model, "prompt": "A job to follow", "max_tokens": 64,
            "temperature": 0, "priority": "high", **OFF}
    with api.http() as client:
        created = client.post("/v1/jobs", json=body)
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = _events(response)
            assert next(events)[0] == "queued"
            _started(api)  # the worker comes after the follower: every token is seen
            seen = list(events)
    names = [name for name, _ in seen]
    assert names[0] == "started" and names[-1] == "finished"
    assert set(names[1:-1]) == {"token"} and len(names) > 3
    finished = seen[-1][1]
    assert finished["status"] == "succeeded"
    text = "".join(data["text"] for name, data in seen if name == "token")
    assert text == finished["result"]["choices"][0]["text"]
    # A job that ended answers at once with its result.
    with api.http() as client, client.stream("GET", f"/v1/jobs/{job_id}/events") as again:
        assert [name for name, _ in _events(again)] == ["finished"]


def _events_with_ids(response: httpx.Response) -> Iterator[tuple[int | None, str, dict[str, Any]]]:
    """(id, event name, data) triples of an SSE response."""
    event_id: int | None = None
    name = "message"
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield event_id, name, json.loads(line[6:])
            event_id, name = None, "message"


def test_job_events_resume_after_the_last_event_id(api: Api) -> None:
    """A follower that drops mid-job and comes back with `Last-Event-ID` gets only the text
    it had not seen: its tokens across both connections join to the result's text."""
    body = {"model": api.model, "prompt": "A job to follow twice", "max_tokens": 300,
            "temperature": 0, "ignore_eos": True, "priority": "high", **OFF}
    with api.http() as client:
        job_id = client.post("/v1/jobs", json=body).json()["id"]
        first: list[tuple[int | None, str, dict[str, Any]]] = []
        worker = None
        try:
            with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
                for event in _events_with_ids(response):
                    first.append(event)
                    if worker is None:  # after the follower: every token is seen
                        worker = api.service.start_worker()
                    if len([e for e in first if e[1] == "token"]) == 3:
                        # Frozen while it runs, so the second connection finds it running.
                        os.kill(worker.pid, signal.SIGSTOP)
                        break
            last_id = first[-1][0]
            assert worker is not None
            with client.stream("GET", f"/v1/jobs/{job_id}/events",
                               headers={"Last-Event-ID": str(last_id)}) as response:
                os.kill(worker.pid, signal.SIGCONT)
                second = list(_events_with_ids(response))
        finally:
            if worker is not None:
                os.kill(worker.pid, signal.SIGCONT)
        bad = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "evt_7"})
        past_end = client.get(f"/v1/jobs/{job_id}/events",
                              headers={"Last-Event-ID": "10000000"})
        with client.stream("GET", f"/v1/jobs/{job_id}/events",
                           headers={"Last-Event-ID": str(last_id)}) as response:
            after_end = list(_events_with_ids(response))
    # Each id counts the text the events up to it hold.
    held = 0
    for event_id, name, data in first + second:
        if name == "token":
            held += len(data["text"])
        assert event_id == held, (name, event_id, held)
    assert [name for _, name, _ in first] == ["queued", "started", "token", "token", "token"]
    assert second[0][1] == "started" and second[0][0] == last_id
    assert second[-1][1] == "finished" and {n for _, n, _ in second[1:-1]} == {"token"}
    result = second[-1][2]
    assert result["status"] == "succeeded"
    text = "".join(d["text"] for _, n, d in first + second if n == "token")
    assert text == result["result"]["choices"][0]["text"]
    assert second[-1][0] == len(text)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
    assert [name for _, name, _ in after_end] == ["finished"]
    assert past_end.status_code == 400, past_end.text


def test_stream_is_refused_where_nothing_relays_it(api: Api) -> None:
    with api.http() as client:
        job = client.post("/v1/jobs", json={"model": api.model, "prompt": "x", "stream": True})
        options = client.post("/v1/completions", json={"model": api.model, "prompt": "x",
                                                       "stream_options": {"include_usage": True}})
        missing = client.get("/v1/jobs/job_missing/events")
    assert job.status_code == 400 and job.json()["error"]["param"] == "stream"
    assert options.status_code == 400
    assert options.json()["error"]["param"] == "stream_options"
    assert missing.status_code == 404
