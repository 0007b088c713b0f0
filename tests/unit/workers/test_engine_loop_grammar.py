"""A request whose schema is compiling is held back; the running batch keeps stepping.

The compile is made to wait on an event (the engine's own `compile_grammar` runs once it
is let go), so what is checked is order, not timing: a large schema takes seconds (0.85 s
for 5,000 properties on two cores) that every running sequence used to wait for.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.engine.tiny_models import save_tiny_llama
from tests.unit.workers.test_engine_loop import Sink, collect, collect_until
from workers.engine import EngineConfig, LLMEngine, SamplingParams
from workers.inference.engine_loop import EngineLoop

SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                     "required": ["ok"], "additionalProperties": False})


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    path: Path = tmp_path_factory.mktemp("tiny-grammar")
    save_tiny_llama(path)
    return LLMEngine(EngineConfig(model=str(path), kv_cache_memory_bytes=16 * 1024 * 1024))


class GatedCompile:
    """The engine's compile, run only once `release` is set; counts its calls."""

    def __init__(self, engine: LLMEngine) -> None:
        self.compile = engine.compile_grammar
        self.release = threading.Event()
        self.calls: list[str | None] = []

    def __call__(self, params: SamplingParams) -> None:
        self.calls.append(params.json_schema)
        assert self.release.wait(60)
        self.compile(params)


@pytest.fixture
def gate(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedCompile]:
    gated = GatedCompile(engine)
    monkeypatch.setattr(engine, "compile_grammar", gated)
    yield gated
    gated.release.set()


@pytest.fixture
def loop(engine: LLMEngine, gate: GatedCompile) -> Iterator[EngineLoop]:
    engine_loop = EngineLoop(engine)
    engine_loop.start()
    try:
        yield engine_loop
    finally:
        gate.release.set()
        engine_loop.stop()


def constrained(max_tokens: int = 16, schema: str = SCHEMA) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, json_schema=schema)


def test_others_run_while_a_schema_compiles_and_it_runs_after(loop: EngineLoop,
                                                              gate: GatedCompile) -> None:
    loop.add("schema", "hi", constrained(), priority=0)
    loop.add("plain", "hi", SamplingParams(max_tokens=8, temperature=0), priority=1)
    # The less urgent plain request finishes while the urgent one's schema compiles.
    assert list(collect(loop, 1)) == ["plain"]
    gate.release.set()
    done: Any = collect(loop, 1)["schema"]
    assert done.output is not None and done.output.finish_reason == "stop", done
    assert json.loads(done.output.text) in ({"ok": True}, {"ok": False})
    # Compiled once: the next request with that schema starts at once.
    loop.add("again", "hi", constrained(), priority=0)
    assert collect(loop, 1)["again"].output is not None
    assert gate.calls == [SCHEMA]


def test_an_abort_while_compiling_is_reported_once_and_the_request_never_runs(
        loop: EngineLoop, gate: GatedCompile) -> None:
    other = json.dumps({"type": "string", "enum": ["a", "b"]})
    loop.add("doomed", "hi", constrained(schema=other), priority=0)
    loop.abort("doomed")
    finished = collect(loop, 1)
    assert finished["doomed"].aborted
    gate.release.set()
    loop.add("marker", "go", SamplingParams(max_tokens=2), priority=1)
    assert list(collect_until(loop, "marker")) == ["marker"]
    assert not loop.engine.has_unfinished_requests()


def test_a_schema_that_cannot_compile_fails_its_request_alone(loop: EngineLoop,
                                                               gate: GatedCompile) -> None:
    gate.release.set()
    bad = json.dumps({"type": "nonsense"})
    loop.add("bad", "hi", constrained(schema=bad), priority=0)
    loop.add("fine", "hi", SamplingParams(max_tokens=2), priority=0)
    finished = collect(loop, 2)
    assert finished["bad"].output is None
    assert finished["bad"].error and "response_format" in finished["bad"].error
    assert finished["fine"].output is not None
    assert loop.is_healthy


def test_a_request_watched_while_compiling_streams_from_its_first_token(
        loop: EngineLoop, gate: GatedCompile) -> None:
    sink = Sink()
    loop.token_sink = sink
    other = json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 3})
    loop.add("followed", "hi", constrained(schema=other), priority=0)
    loop.watch("followed")
    gate.release.set()
    done: Any = collect(loop, 1)["followed"]
    assert done.output is not None
    assert "".join(e.text for e in sink.of("followed")) == done.output.text


def test_an_embedding_engine_loop_runs_its_requests() -> None:
    """Embedding parameters carry no schema: nothing to compile, the request just runs (a
    look for one that assumed sampling parameters stopped every embedding worker)."""
    from workers.engine.embedding_engine import EmbeddingEngine, EmbeddingParams
    from workers.engine.embedding_runner import EmbeddingRunner

    engine = EmbeddingEngine(EmbeddingRunner("all-minilm-l6-v2", device="cpu", streams=1))
    engine_loop = EngineLoop(engine)  # type: ignore[arg-type]
    engine_loop.start()
    try:
        engine_loop.add("e", ["some text"], EmbeddingParams(), priority=0)  # type: ignore[arg-type]
        done = collect(engine_loop, 1)["e"]
        assert done.error is None and done.output is not None
        assert engine_loop.is_healthy
    finally:
        engine_loop.stop()
