"""Requests with several choices (`n`) through the engine loop, on a real tiny engine."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import EngineConfig, LLMEngine, SamplingParams
from workers.inference.engine_loop import EngineLoop, FinishedRequest

PROMPT = list(range(3, 43))  # 40 tokens: two full 16-token blocks to share


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    model_dir: Path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(model_dir)
    return LLMEngine(EngineConfig(model=str(model_dir), block_size=16,
                                  kv_cache_memory_bytes=16 * 1024 * 1024))


@pytest.fixture
def loop(engine: LLMEngine) -> Iterator[EngineLoop]:
    engine_loop = EngineLoop(engine)
    engine_loop.start()
    try:
        yield engine_loop
    finally:
        engine_loop.stop()


def finished_of(loop: EngineLoop, request_id: str, timeout: float = 60.0) -> FinishedRequest:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for done in loop.take_finished(timeout=0.1):
            assert done.request_id == request_id, f"unexpected {done.request_id}"
            return done
    raise AssertionError(f"{request_id} did not finish in {timeout} s")


def test_n_choices_come_back_as_one_request_sharing_the_prompt_blocks(loop: EngineLoop) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    loop.add("job-a", PROMPT, params, priority=1, n=3)
    done = finished_of(loop, "job-a")
    assert done.error is None and done.choices is not None
    assert [c.request_id for c in done.choices] == ["job-a", "job-a#1", "job-a#2"]
    assert done.output is done.choices[0]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in done.choices)
    # Each choice draws its own tokens (seed, seed + 1, seed + 2)...
    assert len({tuple(c.token_ids) for c in done.choices}) == 3
    # ...and the later ones read choice 0's full prompt blocks from the prefix cache.
    assert [c.num_cached_tokens for c in done.choices[1:]] == [32, 32]

    loop.add("job-b", PROMPT, params, priority=1, n=3)
    again = finished_of(loop, "job-b")
    assert again.choices is not None
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in done.choices]


def test_greedy_choices_are_the_same_text(loop: EngineLoop) -> None:
    loop.add("job-g", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0), priority=1, n=2)
    done = finished_of(loop, "job-g")
    assert done.choices is not None and len(done.choices) == 2
    assert done.choices[0].token_ids == done.choices[1].token_ids


def test_a_refused_request_with_choices_fails_once(loop: EngineLoop, engine: LLMEngine) -> None:
    too_long = list(range(engine.max_model_len + 5))
    loop.add("job-r", too_long, SamplingParams(max_tokens=4), priority=1, n=4)
    done = finished_of(loop, "job-r")
    assert done.error is not None and done.choices is None
    assert not engine.has_unfinished_requests()


def test_aborting_a_request_with_choices_aborts_every_choice(
    loop: EngineLoop, engine: LLMEngine
) -> None:
    params = SamplingParams(max_tokens=10_000, temperature=1.0, ignore_eos=True)
    loop.add("job-x", PROMPT, params, priority=1, n=3)
    deadline = time.monotonic() + 30
    while engine.stats().num_running < 3:  # every choice joined
        assert time.monotonic() < deadline, "the choices never all ran"
        time.sleep(0.01)
    loop.abort("job-x")
    done = finished_of(loop, "job-x")
    assert done.aborted
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "a choice kept running after the abort"
        time.sleep(0.01)
