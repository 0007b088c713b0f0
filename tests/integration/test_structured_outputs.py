"""response_format, tools, penalties and logit_bias through the HTTP API, official client.

Each field on the three roads in: a job (`POST /v1/jobs` through the client's generic
`post`), a synchronous call, and a batch line. The API, the scheduler and a worker run as
processes on a tiny random-weight model; the schemas describe finite languages, so a
random model under the grammar must finish a whole, valid document.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from core.structured_outputs import TOOL_CALL_TRIGGER
from tests.unit.engine.tiny_models import byte_level_tokenizer, save_tiny_llama
from tests.utils.batch_service import TERMINAL, BatchService, batch_service, jsonl, parse_jsonl

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["colour", "ok", "tags"],
    "additionalProperties": False,
}
# A string the model can repeat for ever: only the token budget ends it.
UNBOUNDED: dict[str, Any] = {
    "type": "object", "properties": {"note": {"type": "string"}, "ok": {"type": "boolean"}},
    "required": ["note", "ok"], "additionalProperties": False}
RESPONSE_FORMAT: Any = {
    "type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
TOOLS: Any = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a unit.",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                       "required": ["unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {},
                                           "additionalProperties": False}}},
]
MESSAGES: Any = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama directory whose tokenizer has `<tool_call>` as one token, as
    tool-trained models' tokenizers do (Qwen's, Hermes'): a logit bias on it makes the
    model open a call, so `tool_choice: auto` can be tested on random weights."""
    model_dir = tmp_path_factory.mktemp("tiny-llama-structured")
    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens([TOOL_CALL_TRIGGER])
    save_tiny_llama(model_dir, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(model_dir)  # over the one without the trigger
    return model_dir


def trigger_bias(model_dir: Path) -> dict[str, int]:
    """A logit_bias that makes the model write `<tool_call>` whenever it may."""
    from transformers import AutoTokenizer

    token_id = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(TOOL_CALL_TRIGGER)
    return {str(token_id): 100}


@pytest.fixture
def svc(settings: Any, tmp_path: Path, tiny_model: Path) -> Iterator[BatchService]:
    """API, scheduler and worker on the tiny model."""
    with batch_service(settings, tmp_path, tiny_model) as service:
        yield service


def assert_valid_json(text: str | None, schema: dict[str, Any]) -> None:
    """The text parses and the schema accepts it."""
    assert text is not None
    jsonschema.validate(json.loads(text), schema)


def assert_forced_call(message: Any, name: str | None = None) -> None:
    """OpenAI's tool call shape: arguments a JSON string the tool's parameters accept."""
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        assert name is None or call.function.name == name
        assert_valid_json(call.function.arguments, tool["function"]["parameters"])


def test_sync_calls_honour_every_new_field(svc: BatchService, tiny_model: Path) -> None:
    """Chat and text completions with a schema; tools required, named and auto; penalties."""
    client = svc.openai()
    model = svc.settings.model
    chat = client.chat.completions.create(model=model, messages=MESSAGES,
                                          response_format=RESPONSE_FORMAT,
                                          max_tokens=100, temperature=0)
    assert chat.choices[0].finish_reason == "stop", svc.logs()
    assert_valid_json(chat.choices[0].message.content, SCHEMA)

    text = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=100,
                                     temperature=0.9, seed=5,
                                     extra_body={"response_format": {"type": "json_object"}})
    # Sampled at 0.9 it may ramble until max_tokens: the budget then closes the object.
    assert text.choices[0].finish_reason in ("stop", "length")
    assert isinstance(json.loads(text.choices[0].text), dict), text.choices[0].text

    # Pushed to repeat a letter inside a string, the model never ends the document itself:
    # the budget closes it, whole and valid, and says length.
    [letter] = byte_level_tokenizer().encode("a", add_special_tokens=False)
    looping = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=40, temperature=0,
        logit_bias={str(letter): 30}, response_format={
            "type": "json_schema", "json_schema": {"name": "note", "strict": True,
                                                   "schema": UNBOUNDED}})
    assert looping.choices[0].finish_reason == "length"
    assert looping.usage is not None and looping.usage.completion_tokens <= 40
    assert_valid_json(looping.choices[0].message.content, UNBOUNDED)
    assert "aaaa" in (looping.choices[0].message.content or "")

    required = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert required.choices[0].finish_reason == "tool_calls", required
    assert len(required.choices[0].message.tool_calls or []) == 1
    assert_forced_call(required.choices[0].message)

    named = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0)
    assert named.choices[0].finish_reason == "tool_calls"
    assert_forced_call(named.choices[0].message, "get_weather")
    # Streamed, the calls come as `delta.tool_calls`, never as content.
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert not any(c.delta.content for c in choices), chunks
    streamed = [call for c in choices for call in c.delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed if c.function] == [
        (c.function.name, c.function.arguments) for c in named.choices[0].message.tool_calls]
    assert choices[-1].finish_reason == "tool_calls"
    with client.chat.completions.stream(model=model, messages=MESSAGES, tools=TOOLS,
                                        tool_choice="required", parallel_tool_calls=False,
                                        max_tokens=60, temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert_forced_call(final.choices[0].message)
    # The conversation goes on as with OpenAI: the message with the call, as the client
    # returned it (content null, refusal null), then the tool's result.
    call_message = named.choices[0].message
    assert call_message.tool_calls
    follow_up = client.chat.completions.create(
        model=model, tools=TOOLS, max_tokens=8, temperature=0, messages=[
            *MESSAGES, call_message,
            {"role": "tool", "tool_call_id": call_message.tool_calls[0].id, "content": "21"}])
    assert follow_up.choices[0].message.content, (follow_up, svc.logs())
    with pytest.raises(openai.BadRequestError) as orphan:
        client.chat.completions.create(model=model, max_tokens=8, messages=[
            *MESSAGES, {"role": "tool", "tool_call_id": "call_x", "content": "21"}])
    assert orphan.value.param == "messages[1].tool_call_id"

    # auto: the text is the model's own, until it opens a call (here the trigger token is
    # forced by a bias, which the grammar then overrules: the random model must write one
    # whole call of one of the tools, arguments its schema accepts, and stop).
    auto = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="auto",
        parallel_tool_calls=False, logit_bias=trigger_bias(tiny_model), max_tokens=200,
        temperature=0)
    assert auto.choices[0].finish_reason == "tool_calls", (auto, svc.logs())
    assert len(auto.choices[0].message.tool_calls or []) == 1
    assert_forced_call(auto.choices[0].message)
    free = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                          max_tokens=16, temperature=0)
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content

    # A bias of -100 on every token the unbiased answer used keeps greedy off all of them.
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3)
    assert plain.choices[0].logprobs and plain.choices[0].logprobs.content
    for position in plain.choices[0].logprobs.content:  # greedy: the best alternative
        best = position.top_logprobs
        assert len(best) == 3 and best[0].token == position.token
        assert best[0].logprob == position.logprob >= best[1].logprob >= best[2].logprob
    legacy = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=3,
                                       temperature=0, logprobs=2)
    # A prompt in OpenAI's other forms: token ids, or a list of one prompt.
    by_ids = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=3,
                                       temperature=0)
    assert by_ids.choices[0].text and by_ids.usage and by_ids.usage.prompt_tokens == 4
    listed = client.completions.create(model=model, prompt=["the quick brown fox"],
                                       max_tokens=3, temperature=0, logprobs=2)
    assert listed.choices[0].text == legacy.choices[0].text
    legacy_logprobs = legacy.choices[0].logprobs
    assert legacy_logprobs and legacy_logprobs.top_logprobs and legacy_logprobs.tokens
    for alternatives, token in zip(legacy_logprobs.top_logprobs, legacy_logprobs.tokens,
                                   strict=True):
        # Two alternatives that render alike share a key, as in OpenAI's shape.
        assert token in alternatives and 1 <= len(alternatives) <= 2
    first = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                           temperature=0, presence_penalty=2.0,
                                           frequency_penalty=2.0)
    # Nothing generated yet: the first token cannot be penalised.
    assert first.choices[0].message.content == plain.choices[0].logprobs.content[0].token


def test_logit_bias_bans_the_greedy_token(svc: BatchService, tiny_model: Path) -> None:
    """The greedy first token, biased by -100, is not chosen; +100 on another forces it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    client = svc.openai()
    model = svc.settings.model
    greedy = client.completions.create(model=model, prompt="hello", max_tokens=1,
                                       temperature=0).choices[0].text
    # Every id that renders as the greedy token (byte-level pieces can share a text).
    greedy_ids = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == greedy]
    assert greedy_ids
    banned = client.completions.create(model=model, prompt="hello", max_tokens=1,
                                       temperature=0,
                                       logit_bias={str(i): -100 for i in greedy_ids})
    assert banned.choices[0].text != greedy
    forced_id = tokenizer.encode("fox", add_special_tokens=False)[0]
    forced = client.completions.create(model=model, prompt="hello", max_tokens=1,
                                       temperature=0, logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == tokenizer.decode([forced_id])


def test_jobs_and_batch_lines_carry_the_fields(svc: BatchService, tiny_model: Path) -> None:
    """A job and batch lines with response_format and tools; a bad schema is a 400."""
    client = svc.openai()
    model = svc.settings.model
    job: Any = client.post("/jobs", cast_to=object, body={
        "model": model, "messages": MESSAGES, "response_format": RESPONSE_FORMAT,
        "max_tokens": 100, "temperature": 0.7, "seed": 1, "frequency_penalty": 0.5,
        "logit_bias": {"5": 2.0}})
    done: Any = client.get(f"/jobs/{job['id']}?wait=120", cast_to=object)
    assert done["status"] == "succeeded", (done, svc.logs())
    assert_valid_json(done["result"]["choices"][0]["message"]["content"], SCHEMA)

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=MESSAGES,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "nonsense"}}})
    assert refused.value.param == "response_format"
    assert "nonsense" in str(refused.value)
    # Under strict, a keyword the grammar would ignore is refused by name, before anything
    # compiles (without strict the grammar enforces what it can, as a goal).
    with pytest.raises(openai.BadRequestError) as unenforced:
        client.chat.completions.create(model=model, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {
                "type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}}})
    assert unenforced.value.param == "response_format"
    assert "'multipleOf' at properties.n cannot be enforced" in str(unenforced.value)
    # Parameters with $defs and $ref, as pydantic writes them, under a forced call.
    nested: Any = {"type": "function", "function": {"name": "send", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}},
        "required": ["to"], "additionalProperties": False,
        "$defs": {"Address": {"type": "object", "properties": {"city": {"enum": ["Oslo"]}},
                              "required": ["city"], "additionalProperties": False}}}}}
    sent = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[nested], tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert sent.choices[0].finish_reason == "tool_calls", (sent, svc.logs())
    [call] = sent.choices[0].message.tool_calls or []
    assert_valid_json(call.function.arguments, nested["function"]["parameters"])

    lines = [
        {"custom_id": "schema", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": MESSAGES, "response_format": RESPONSE_FORMAT,
                  "max_tokens": 100, "temperature": 0}},
        {"custom_id": "tools", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": MESSAGES, "tools": TOOLS,
                  "tool_choice": "required", "parallel_tool_calls": False,
                  "max_tokens": 60, "temperature": 0}},
        {"custom_id": "auto", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": MESSAGES, "tools": TOOLS,
                  "parallel_tool_calls": False, "logit_bias": trigger_bias(tiny_model),
                  "max_tokens": 200, "temperature": 0}},
        {"custom_id": "history", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "max_tokens": 8, "temperature": 0, "messages": [
             *MESSAGES,
             {"role": "assistant", "content": None, "tool_calls": [{
                 "id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "21"}]}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": MESSAGES, "tools": TOOLS,
                  "tool_choice": {"type": "function", "function": {"name": "missing"}}}},
    ]
    uploaded = client.files.create(file=("lines.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    finished = svc.wait_batch(client, batch.id, lambda b: b.status in TERMINAL)
    assert finished.status == "completed", finished
    assert finished.output_file_id, svc.logs()
    output = {line["custom_id"]: line
              for line in parse_jsonl(client.files.content(finished.output_file_id).content)}
    assert_valid_json(output["schema"]["response"]["body"]["choices"][0]["message"]["content"],
                      SCHEMA)
    tools_choice = output["tools"]["response"]["body"]["choices"][0]
    assert tools_choice["finish_reason"] == "tool_calls"
    for call in tools_choice["message"]["tool_calls"]:
        json.loads(call["function"]["arguments"])
    auto_choice = output["auto"]["response"]["body"]["choices"][0]
    assert auto_choice["finish_reason"] == "tool_calls"
    [auto_call] = auto_choice["message"]["tool_calls"]
    auto_tool = next(t for t in TOOLS if t["function"]["name"] == auto_call["function"]["name"])
    assert_valid_json(auto_call["function"]["arguments"], auto_tool["function"]["parameters"])
    history_choice = output["history"]["response"]["body"]["choices"][0]
    assert history_choice["message"]["content"] and history_choice["finish_reason"] in (
        "stop", "length")
    assert finished.error_file_id
    [error] = parse_jsonl(client.files.content(finished.error_file_id).content)
    assert error["custom_id"] == "bad"
    assert "missing" in error["response"]["body"]["error"]["message"]

    # The same schema through a /v1/responses batch line: a Responses object comes back.
    response_line = {"custom_id": "resp", "method": "POST", "url": "/v1/responses", "body": {
        "model": model, "instructions": "Answer in JSON.", "max_output_tokens": 100,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
        "temperature": 0, "text": {"format": {"type": "json_schema", "name": "thing",
                                              "schema": SCHEMA, "strict": True}}}}
    uploaded = client.files.create(file=("responses.jsonl", jsonl([response_line])),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses",
                                  completion_window="24h")
    finished = svc.wait_batch(client, batch.id, lambda b: b.status in TERMINAL)
    assert finished.status == "completed" and finished.output_file_id, (finished, svc.logs())
    [line] = parse_jsonl(client.files.content(finished.output_file_id).content)
    body = line["response"]["body"]
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["instructions"] == "Answer in JSON."  # echoed, as a call's response does
    assert_valid_json(body["output"][0]["content"][0]["text"], SCHEMA)
    assert body["usage"]["output_tokens"] > 0

