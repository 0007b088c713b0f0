"""The model's context at submission: the API refuses what the engine would, and no more.

The served model `test-model` is a real (random-weight) Llama directory under the API's
`models_dir`, with a 64-token context and a byte-level tokenizer with a chat template.
The engine built on the same directory is the judge: the longest prompt it takes is
accepted by the API, one token more is refused by both.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.capabilities import MAX_PROMPT_CHARS_ON_LOOP, can_check_without_io
from api.resources import Resources
from core.model_context import ModelContexts, find_model_dir, model_contexts
from core.requests import JobCreate
from storage.model_cards import publish_card
from tests.unit.api.conftest import MODEL, ClientFactory
from tests.unit.api.hostile_cases import send_json
from tests.unit.api.test_hostile_input import assert_refused
from tests.unit.engine.tiny_models import save_tiny_llama
from tests.utils.api import RecordingProducer, TenantKey, count_jobs
from workers.engine import EngineConfig, LLMEngine, SamplingParams

CONTEXT = 64
WORDS = "the quick brown fox jumps over the lazy dog "


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory holding `test-model` with a 64-token context."""
    root = tmp_path_factory.mktemp("models")
    save_tiny_llama(root / MODEL, max_position_embeddings=CONTEXT)
    return root


@pytest.fixture(scope="module")
def engine(models_dir: Path) -> LLMEngine:
    """The engine a worker would run on that model (CPU, a small pool)."""
    return LLMEngine(EngineConfig(model=MODEL, models_dir=models_dir, dtype="float32",
                                  device="cpu", block_size=16, num_kv_blocks=64))


@pytest.fixture
def client(make_client: ClientFactory, models_dir: Path) -> TestClient:
    """An API that finds `test-model` under its models_dir."""
    return make_client(models_dir=models_dir)


def engine_takes(engine: LLMEngine | _WithTools,
                 prompt: str | list[int] | list[dict[str, Any]]) -> bool:
    """Whether the engine accepts the prompt (it is aborted again at once)."""
    try:
        engine.add_request("probe", prompt, SamplingParams(max_tokens=1))
    except ValueError:
        return False
    engine.abort("probe")
    return True


def longest_taken(engine: LLMEngine | _WithTools, make: Callable[[int], Any]) -> int:
    """The largest n for which the engine takes make(n)."""
    n = 1
    while engine_takes(engine, make(n + 1)):
        n += 1
    assert engine_takes(engine, make(n)), "even the shortest prompt is refused"
    return n


def text_of(n: int) -> str:
    """A prompt that grows with n, whatever the tokenizer merges."""
    return (WORDS * 20)[: 4 * n]


def chat_of(n: int) -> list[dict[str, Any]]:
    """Chat messages that grow with n."""
    return [{"role": "user", "content": text_of(n)}]


def test_longest_prompt_the_engine_takes_is_accepted_and_one_more_is_refused(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, engine: LLMEngine,
) -> None:
    """Text and chat, without max_tokens: the API's boundary is the engine's."""
    n_text = longest_taken(engine, text_of)
    n_chat = longest_taken(engine, chat_of)
    base: dict[str, Any] = {"model": MODEL}
    assert n_text > 8 and n_chat > 8, "the model's context should hold a few words"
    too_long: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/jobs", base | {"prompt": text_of(n_text + 1)}, "prompt"),
        ("/v1/completions", base | {"prompt": text_of(n_text + 1)}, "prompt"),
        ("/v1/jobs", base | {"messages": chat_of(n_chat + 1)}, "messages"),
        ("/v1/chat/completions", base | {"messages": chat_of(n_chat + 1)}, "messages"),
    ]
    for path, body, param in too_long:
        error = assert_refused(client, acme, sessions, producer, path, body, status=400,
                               param=param)
        assert error["code"] == "context_length_exceeded"
        assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    for body in (base | {"prompt": text_of(n_text)}, base | {"messages": chat_of(n_chat)}):
        response = send_json(client, "/v1/jobs", body, acme.headers)
        assert response.status_code == 202, response.text
    assert count_jobs(sessions) == 2


def test_prompt_and_max_tokens_together_must_fit(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, engine: LLMEngine,
) -> None:
    """Prompt tokens plus max_tokens over the context: 400 with both counts, as OpenAI says."""
    messages = chat_of(5)
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True)
    num_prompt = len(engine.tokenizer(text, add_special_tokens=False).input_ids)
    fits = {"model": MODEL, "messages": messages, "max_tokens": CONTEXT - num_prompt}
    for path in ("/v1/jobs", "/v1/chat/completions"):
        error = assert_refused(client, acme, sessions, producer, path,
                               fits | {"max_tokens": CONTEXT - num_prompt + 1}, status=400,
                               param="messages")
        assert (f"you requested {CONTEXT + 1} tokens ({num_prompt} in the messages, "
                f"{CONTEXT - num_prompt + 1} in the completion)") in error["message"]
    response = send_json(client, "/v1/jobs", fits, acme.headers)
    assert response.status_code == 202, response.text


TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "lookup", "description": "Find a word.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]
WIDE_CONTEXT = 1024  # room for the tools' description in the system message


@pytest.fixture(scope="module")
def wide_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`test-model` again, with a 1,024-token context."""
    root = tmp_path_factory.mktemp("wide-models")
    save_tiny_llama(root / MODEL, max_position_embeddings=WIDE_CONTEXT)
    return root


def test_tools_and_tool_history_count_as_the_worker_renders_them(
    make_client: ClientFactory, wide_models_dir: Path, acme: TenantKey,
    sessions: sessionmaker[Session], producer: RecordingProducer,
) -> None:
    """The tools a request offers, and a call with its result, are part of the prompt: the
    API's boundary is still the engine's (they were counted without, and such prompts
    failed only in the worker)."""
    client = make_client(models_dir=wide_models_dir)
    engine = LLMEngine(EngineConfig(model=MODEL, models_dir=wide_models_dir, dtype="float32",
                                    device="cpu", block_size=16, num_kv_blocks=128))
    history = [{"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "lookup", "arguments": '{"word": "fox"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a small wild dog " * 10}]

    def chat(n: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": (WORDS * 200)[: 4 * n]}]

    plain = longest_taken(engine, chat)
    fitting = []
    for tools, make in ((TOOLS, chat), (None, lambda n: chat(n) + history)):
        n = longest_taken(_WithTools(engine, tools), make)
        assert n < plain - 8, "the tools or the calls should take room"
        extra = {"tools": tools} if tools else {}
        body = {"model": MODEL, "messages": make(n + 1)} | extra
        error = assert_refused(client, acme, sessions, producer, "/v1/chat/completions",
                               body, status=400, param="messages")
        assert error["code"] == "context_length_exceeded"
        fitting.append(body | {"messages": make(n)})
    for body in fitting:
        response = send_json(client, "/v1/jobs", body, acme.headers)
        assert response.status_code == 202, response.text


class _WithTools:
    """`engine_takes`'s view of an engine whose requests offer `tools`."""

    def __init__(self, engine: LLMEngine, tools: list[dict[str, Any]] | None = None) -> None:
        self.engine, self.tools = engine, tools

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt, params, tools=self.tools)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/jobs", {"prompt": "hi"}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/jobs", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_over_the_context_is_400_naming_it(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, path: str, body: dict[str, Any], name: str,
) -> None:
    """1e9 tokens (an integer) for a 64-token model: refused under the name it came as."""
    error = assert_refused(client, acme, sessions, producer, path,
                           {"model": MODEL, name: 10**9} | body, status=400, param=name)
    assert f"context of {CONTEXT} tokens" in error["message"]


def test_model_not_on_this_machine_is_not_limited_by_a_guess(
    make_client: ClientFactory, acme: TenantKey, tmp_path: Path,
) -> None:
    """Without the model's files the API cannot know its context; the worker judges."""
    client = make_client(models_dir=tmp_path / "empty")
    body = {"model": MODEL, "prompt": WORDS * 200, "max_tokens": 10**9}
    assert send_json(client, "/v1/jobs", body, acme.headers).status_code == 202


def test_chat_template_refusal_is_400(
    make_client: ClientFactory, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, tmp_path: Path,
) -> None:
    """A template that raises on these messages (the worker's would too): 400, messages."""
    models = tmp_path / "models"
    save_tiny_llama(models / MODEL)
    template = models / MODEL / "chat_template.jinja"  # where transformers saves it
    text = template.read_text().replace(
        "{{ bos_token }}", "{{ raise_exception('roles must alternate') }}", 1)
    assert text != template.read_text(), "the template changed: update this test"
    template.write_text(text)
    client = make_client(models_dir=models)
    error = assert_refused(client, acme, sessions, producer, "/v1/jobs",
                           {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                           status=400, param="messages")
    assert "roles must alternate" in error["message"]


def test_model_directories_are_found_as_workers_find_them(tmp_path: Path) -> None:
    """A prepared name, a directory path, a GGUF's converted copy; a late pull is seen."""
    models = tmp_path / "models"
    contexts = ModelContexts(models)
    assert contexts.get("late") is None
    (models / "late").mkdir(parents=True)
    (models / "late" / "config.json").write_text('{"max_position_embeddings": 128}')
    late = contexts.get("late")
    assert late is not None and late.max_model_len == 128 and late.tokenizer is None
    assert find_model_dir(str(models / "late"), tmp_path / "elsewhere") == models / "late"
    gguf = tmp_path / "weights" / "tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    assert find_model_dir(str(gguf), models) is None  # not converted yet
    (models / "gguf" / "tiny").mkdir(parents=True)
    (models / "gguf" / "tiny" / "config.json").write_text("{}")
    assert find_model_dir(str(gguf), models) == models / "gguf" / "tiny"
    assert find_model_dir(str(gguf.parent), models) == models / "gguf" / "tiny"
    assert find_model_dir("a/b", models) is None


def test_a_model_served_under_its_own_name_is_found_by_its_card(
    make_client: ClientFactory, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, models_dir: Path, tmp_path: Path, redis_url: str,
) -> None:
    """Not under models_dir by that name: the directory its workers announced is used."""
    prefix = f"t{tmp_path.name[-10:]}"
    client = make_client(models_dir=tmp_path / "empty", topic_prefix=prefix)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}
    assert send_json(client, "/v1/jobs", body, acme.headers).status_code == 202
    with redis.Redis.from_url(redis_url) as r:
        publish_card(r, prefix=prefix, name=MODEL,
                     card={"name": MODEL, "path": str(models_dir / MODEL),
                           "context_length": CONTEXT})
    sessions_before = count_jobs(sessions)
    response = send_json(client, "/v1/jobs", body, acme.headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "max_tokens"
    assert count_jobs(sessions) == sessions_before


def test_warm_up_loads_contexts_in_the_background(models_dir: Path) -> None:
    """After warm_up, the context is there without a load on the request's path."""
    contexts = ModelContexts(models_dir)
    contexts.warm_up([MODEL, "not-here"]).join(timeout=120)
    context = contexts.loaded(MODEL)
    assert context is not None and context.max_model_len == CONTEXT
    assert context.tokenizer is not None


@pytest.mark.parametrize("text", [
    "the quick brown fox", "<s> a </s> b", "héllo 日本語 \U0001F600 tabs\tand\nlines", "  x", "",
])
def test_prompt_tokens_are_counted_as_the_tokenizer_counts_them(
    models_dir: Path, text: str
) -> None:
    """The Rust encode the count uses gives `len(tokenizer(text).input_ids)`, and the
    tokenizer's own call is used when its backend carries options that call would reset."""
    context = ModelContexts(models_dir).get(MODEL)
    assert context is not None and context.tokenizer is not None
    expected = len(context.tokenizer(text).input_ids)
    assert context.count_prompt_tokens({"prompt": text}) == expected
    context.tokenizer.backend_tokenizer.enable_truncation(max_length=2)
    try:
        assert context.count_prompt_tokens({"prompt": text}) == expected
    finally:
        context.tokenizer.backend_tokenizer.no_truncation()


def test_short_prompts_of_loaded_models_are_checked_on_the_event_loop(
    models_dir: Path, make_settings: Callable[..., Any]
) -> None:
    """No I/O to wait for: a model not served, or loaded and a short prompt. Otherwise the
    check goes to the thread pool (a context still to load, a long prompt)."""
    resources = cast(Resources, SimpleNamespace(
        settings=make_settings(models_dir=models_dir, served_models=[MODEL, "elsewhere"])))
    short, long = "x " * 10, "x " * MAX_PROMPT_CHARS_ON_LOOP

    def chat(content: str) -> JobCreate:
        return JobCreate.model_validate(
            {"model": MODEL, "messages": [{"role": "user", "content": content}]})

    model_contexts(models_dir).get(MODEL)
    assert can_check_without_io(JobCreate(model=MODEL, prompt=short), resources)
    assert can_check_without_io(chat(short), resources)
    assert not can_check_without_io(JobCreate(model=MODEL, prompt=long), resources)
    assert not can_check_without_io(chat(long), resources)
    assert can_check_without_io(JobCreate(model="not-served", prompt=short), resources)
    assert not can_check_without_io(JobCreate(model="elsewhere", prompt=short), resources)


def test_long_prompts_that_fit_by_their_length_stay_on_the_event_loop(
    tmp_path: Path, make_settings: Callable[..., Any]
) -> None:
    """A prompt past MAX_PROMPT_CHARS_ON_LOOP goes to the thread pool only when it needs
    counting: with a 16k context, 5,000 one-byte characters fit by their length alone."""
    models_dir = tmp_path / "models"
    save_tiny_llama(models_dir / MODEL, max_position_embeddings=16384)
    resources = cast(Resources, SimpleNamespace(
        settings=make_settings(models_dir=models_dir, served_models=[MODEL])))
    model_contexts(models_dir).get(MODEL)
    fits = "x" * (MAX_PROMPT_CHARS_ON_LOOP + 1000)
    assert can_check_without_io(JobCreate(model=MODEL, prompt=fits, max_tokens=100), resources)
    assert not can_check_without_io(JobCreate(model=MODEL, prompt=fits, max_tokens=12000),
                                     resources)
    assert not can_check_without_io(JobCreate(model=MODEL, prompt="x" * 17000), resources)


def test_a_prompt_of_token_ids_is_counted_as_its_length(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer,
) -> None:
    """Token ids need no tokenizer: the context holds CONTEXT of them, with max_tokens."""
    too_long = {"model": MODEL, "prompt": [5] * CONTEXT, "max_tokens": 1}
    error = assert_refused(client, acme, sessions, producer, "/v1/completions", too_long,
                           status=400, param="prompt")
    assert error["code"] == "context_length_exceeded"
    fits = {"model": MODEL, "prompt": [[5] * (CONTEXT - 1)], "max_tokens": 1}
    response = send_json(client, "/v1/jobs", fits, acme.headers)
    assert response.status_code == 202, response.text


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/completions"])
@pytest.mark.parametrize(("patch", "param"), [
    ({"prompt": [5, 10**9]}, "prompt"),
    ({"prompt": [[10**6]]}, "prompt"),
    ({"prompt": "hi", "logit_bias": {"999999999": 5}}, "logit_bias"),
])
def test_token_ids_the_model_lacks_are_refused_at_submission(
    client: TestClient, acme: TenantKey, sessions: sessionmaker[Session],
    producer: RecordingProducer, engine: LLMEngine, path: str, patch: dict[str, Any],
    param: str,
) -> None:
    """The engine's own check, made before anything is queued (a job took them and then
    failed in the worker); the first id past the vocabulary is refused, the last in it
    is not."""
    error = assert_refused(client, acme, sessions, producer, path,
                           {"model": MODEL, "max_tokens": 1} | patch, status=400, param=param)
    assert f"outside [0, {engine.vocab_size})" in error["message"]
    last = {"model": MODEL, "max_tokens": 1, "prompt": [engine.vocab_size - 1],
            "logit_bias": {str(engine.vocab_size - 1): 1}}
    assert engine_takes(engine, [engine.vocab_size - 1])
    assert not engine_takes(engine, [engine.vocab_size])
    assert send_json(client, "/v1/jobs", last, acme.headers).status_code == 202
