"""LLMEngine and LLM on a random-weight Llama: the public surface, end to end on CPU."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from workers.engine.prompts import Prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight model with a byte-level tokenizer and a chat template."""
    path = tmp_path_factory.mktemp("tiny-llama-engine")
    save_tiny_llama(path, seed=7)
    return path


def engine_options(**options: Any) -> dict[str, Any]:
    """fp32 on CPU; a 1,024-block pool rather than the 1 GiB default, which is slow to set up."""
    return {"dtype": "float32", "device": "cpu", "block_size": 16, "num_kv_blocks": 1024,
            **options}  # fmt: skip


def make_engine(model_dir: Path, **options: Any) -> LLMEngine:
    """An engine over the tiny model."""
    return LLMEngine(EngineConfig(model=str(model_dir), **engine_options(**options)))


def make_llm(model_dir: Path, **options: Any) -> LLM:
    """An offline LLM over the tiny model."""
    return LLM(str(model_dir), **engine_options(**options))


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until idle; every output per request, in order."""
    seen: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    """Greedy parameters that run to max_tokens."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    """Token ids that avoid the special tokens."""
    return [rng.randrange(3, 300) for _ in range(length)]


def test_step_streams_deltas_that_add_up(model_dir: Path) -> None:
    """Deltas concatenate to the final text and tokens; one finished output per request."""
    engine = make_engine(model_dir)
    engine.add_request("text", "the quick brown fox", greedy(12))
    engine.add_request("ids", [5, 6, 7, 8], greedy(5, logprobs=True))
    engine.add_request("chat", [{"role": "user", "content": "hello"}], greedy(3))
    seen = run_all(engine)
    for request_id, outs in seen.items():
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1]), request_id
        assert "".join(o.delta_text for o in outs) == final.text
        assert sum((o.delta_token_ids for o in outs), []) == final.token_ids
        assert final.finish_reason == "length"
        m = final.metrics
        assert m.first_scheduled_time is not None and m.first_token_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
        assert m.finish_time is not None and m.first_token_time <= m.finish_time
    assert (
        len(seen["text"][-1].token_ids) == 12 and seen["text"][-1].prompt == "the quick brown fox"
    )
    ids = seen["ids"][-1]
    assert ids.prompt is None and ids.prompt_token_ids == [5, 6, 7, 8]
    assert ids.logprobs is not None and len(ids.logprobs) == 5
    assert all(lp <= 0 for lp in ids.logprobs) and seen["text"][-1].logprobs is None
    chat = seen["chat"][-1]
    assert chat.prompt is not None and chat.prompt.endswith("<|assistant|>")
    tok = engine.tokenizer
    assert chat.prompt_token_ids == tok(chat.prompt, add_special_tokens=False).input_ids
    assert engine.stats().num_kv_blocks_used == 0


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", None, "prompt"),
        ([], None, "prompt"),
        ([1] * 600, None, "prompt"),  # beyond max_model_len
        ([5, 300], None, "prompt"),  # outside the vocabulary
        ([{"content": "no role"}], None, "role"),
        ("fine", {"max_tokens": 0}, "max_tokens"),
        ("fine", {"temperature": -1}, "temperature"),
        ("fine", {"top_p": 0}, "top_p"),
        ([5] * 100, {"max_tokens": 500}, "max_tokens"),  # could never fit the KV pool
    ],
)
def test_bad_input_names_the_field_and_spares_the_others(
    model_dir: Path, prompt: Any, params: dict[str, Any] | None, field: str
) -> None:
    """A bad request raises ValueError naming the field; a good one beside it completes."""
    engine = make_engine(model_dir, max_model_len=512, num_kv_blocks=16)
    engine.add_request("good", [5, 6, 7], greedy(4))
    engine.step()
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, SamplingParams(**params) if params else None)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("good", [5], greedy(1))
    outs = run_all(engine)
    assert set(outs) == {"good"} and len(outs["good"][-1].token_ids) == 4
    assert engine.stats().num_kv_blocks_used == 0


def test_engine_takes_tenant_and_weight_and_refuses_bad_ones(model_dir: Path) -> None:
    """add_request passes the tenant through; a weight <= 0 or a non-string tenant is a
    ValueError naming it, and the engine keeps running the good requests."""
    engine = make_engine(model_dir, max_model_len=512, num_kv_blocks=16)
    engine.add_request("good", [5, 6, 7], greedy(2), tenant="acme", tenant_weight=2)
    (queued,) = engine.scheduler.waiting
    assert (queued.tenant, queued.weight) == ("acme", 2.0)
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="tenant_weight"):
            engine.add_request("bad", [5], greedy(1), tenant="acme", tenant_weight=bad)
    with pytest.raises(ValueError, match="tenant"):
        engine.add_request("bad", [5], greedy(1), tenant=7)  # type: ignore[arg-type]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_kv_blocks_used == 0


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])


@OVERLAP
def test_abort_frees_blocks_and_unknown_ids_are_ignored(model_dir: Path, overlap: bool) -> None:
    """Aborting running and waiting requests frees everything; unknown ids do nothing."""
    engine = make_engine(model_dir, max_num_seqs=2, overlap_output_processing=overlap)
    rng = random.Random(0)
    for i in range(4):
        engine.add_request(f"r{i}", random_prompt(rng, 40), greedy(50))
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 2 and stats.num_waiting == 2 and stats.num_kv_blocks_used > 0
    engine.abort("no-such-request")
    engine.abort("r0")  # running
    engine.abort("r3")  # waiting
    engine.abort("r0")  # twice: still a no-op
    outs = run_all(engine)
    assert set(outs) == {"r1", "r2"}
    stats = engine.stats()
    assert stats.num_kv_blocks_used == 0 and stats.num_kv_blocks_free == engine.runner.num_kv_blocks
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_generated_tokens >= 100 and stats.generation_tokens_per_s > 0
    assert stats.tokens_per_s > stats.generation_tokens_per_s


def test_alone_equals_inside_a_batch_of_64(model_dir: Path) -> None:
    """Greedy output of one request does not depend on what shares its batches."""
    rng = random.Random(1)
    target = random_prompt(rng, 77)
    alone = make_llm(model_dir).generate([target], greedy(20))
    others = [random_prompt(rng, rng.randint(1, 200)) for _ in range(63)]
    batch = [*others[:31], target, *others[31:]]
    params = [greedy(rng.randint(1, 20)) for _ in range(31)] + [greedy(20)]
    params += [greedy(rng.randint(1, 20)) for _ in range(32)]
    llm = make_llm(model_dir, max_num_batched_tokens=256)
    outputs = llm.generate(batch, params)
    assert [o.request_id for o in outputs] == sorted(
        (o.request_id for o in outputs), key=lambda r: int(r.split("-")[1])
    )
    assert outputs[31].token_ids == alone[0].token_ids
    assert outputs[31].prompt_token_ids == target


def test_seeded_sampling_is_reproducible_across_batch_compositions(model_dir: Path) -> None:
    """The same seed gives the same tokens alone, in a crowd, and after preemption."""
    rng = random.Random(2)
    prompt = random_prompt(rng, 30)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24,
                            ignore_eos=True)  # fmt: skip
    alone = make_llm(model_dir).generate([prompt], seeded)[0]
    crowd_prompts = [random_prompt(rng, rng.randint(5, 120)) for _ in range(12)]
    crowd_params = [SamplingParams(temperature=1.0, max_tokens=24, seed=i) for i in range(12)]
    llm = make_llm(model_dir, num_kv_blocks=12)
    outs = llm.generate([*crowd_prompts[:6], prompt, *crowd_prompts[6:]],
                        [*crowd_params[:6], seeded, *crowd_params[6:]])  # fmt: skip
    assert outs[6].token_ids == alone.token_ids
    assert llm.engine.stats().num_preemptions > 0
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=24,
                                ignore_eos=True)  # fmt: skip
    assert llm.generate([prompt], other_seed)[0].token_ids != alone.token_ids


@OVERLAP
def test_stop_strings_and_stop_token_ids(model_dir: Path, overlap: bool) -> None:
    """A stop string is trimmed from the text; a stop token id ends the output with it.

    With overlap the stop string is found while the next step runs: the same output."""
    llm = make_llm(model_dir, overlap_output_processing=overlap)
    prompt = "hello world"
    free = llm.generate(prompt, greedy(30))[0]
    assert len(free.text) > 6, "the model should say something visible"
    stop = free.text[3:6]
    cut = llm.generate(prompt, greedy(30, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    stop_id = free.token_ids[4]
    by_id = llm.generate(prompt, greedy(30, stop_token_ids=[stop_id]))[0]
    first = free.token_ids.index(stop_id)
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: first + 1]


def test_generate_accepts_every_prompt_form_in_order(model_dir: Path) -> None:
    """Text, token ids and chat messages, single or batched, come back in input order."""
    llm = make_llm(model_dir)
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    prompts: list[Prompt] = ["a b c", [7, 8, 9], chat]
    batch = llm.generate(prompts, greedy(4))
    assert [o.prompt for o in batch][:2] == ["a b c", None]
    assert llm.generate("a b c", greedy(4))[0].token_ids == batch[0].token_ids
    assert llm.generate([7, 8, 9], greedy(4))[0].token_ids == batch[1].token_ids
    assert llm.generate(chat, greedy(4))[0].token_ids == batch[2].token_ids
    assert llm.generate([], greedy(4)) == []
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [greedy(1)])
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], greedy(2))
    assert not llm.engine.has_unfinished_requests()  # the half-added batch was withdrawn
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_finished_only_steps_give_the_final_outputs_of_full_steps(model_dir: Path) -> None:
    """step(finished_only=True) returns exactly the finished outputs step() would, and a
    text prompt with its ids given runs as the same text encoded by the engine."""
    rng = random.Random(3)
    outputs = []
    for finished_only in (False, True):
        engine = make_engine(model_dir)
        for i in range(6):
            engine.add_request(f"r{i}", random_prompt(rng, 5 + i), greedy(3 + 2 * i))
        ids = engine.tokenizer("a b c").input_ids
        engine.add_request("text", "a b c", greedy(4), prompt_token_ids=ids)
        seen = []
        while engine.has_unfinished_requests():
            step = engine.step(finished_only=finished_only)
            if finished_only:
                assert all(o.finished for o in step)
            seen += [(o.request_id, o.token_ids, o.text) for o in step if o.finished]
        outputs.append(sorted(seen))
        rng = random.Random(3)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 7
    alone = make_llm(model_dir).generate("a b c", greedy(4))[0]
    assert ("text", alone.token_ids, alone.text) in outputs[1]
    engine = make_engine(model_dir)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("bad", "a b c", greedy(1), prompt_token_ids=[10**6])
    assert not engine.has_unfinished_requests()


def test_eos_and_max_model_len_end_requests(model_dir: Path) -> None:
    """Without ignore_eos the eos token stops; a sequence never outgrows max_model_len."""
    engine = make_engine(model_dir, max_model_len=40)
    engine.add_request("long", [9] * 30, greedy(100))
    assert engine.max_model_len == 40
    out = run_all(engine)["long"][-1]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    engine.add_request("eos", [9] * 3, SamplingParams(temperature=0, max_tokens=30))
    final = run_all(engine)["eos"][-1]
    if final.finish_reason == "stop":
        assert final.token_ids[-1] == 2 and 2 not in final.token_ids[:-1]
    else:
        assert 2 not in final.token_ids


def test_skip_tokenizer_init_serves_token_ids_only(model_dir: Path) -> None:
    """Without a tokenizer, token ids work, text prompts and stop strings are refused."""
    engine = make_engine(model_dir, skip_tokenizer_init=True)
    assert engine.tokenizer is None
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("text", "hello", greedy(2))
    with pytest.raises(ValueError, match="stop"):
        engine.add_request("stop", [5], greedy(2, stop=["x"]))
    engine.add_request("ids", [5, 6], greedy(3))
    out = run_all(engine)["ids"][-1]
    assert out.text == "" and len(out.token_ids) == 3


def test_priority_request_overtakes_a_full_engine(model_dir: Path) -> None:
    """With the only seat taken, a more urgent request runs next step and finishes first."""
    engine = make_engine(model_dir, max_num_seqs=1)
    engine.add_request("low", [5, 6, 7], greedy(30), priority=5)
    engine.step()
    engine.add_request("high", [8, 9], greedy(3), priority=0)
    finished_order = []
    while engine.has_unfinished_requests():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order == ["high", "low"]
    assert engine.stats().num_preemptions == 1


@OVERLAP
def test_random_adds_aborts_and_priorities_leave_no_block_held(
    model_dir: Path, overlap: bool
) -> None:
    """A random mix of arrivals, priorities and aborts on a tight pool ends fully free."""
    rng = random.Random(11)
    engine = make_engine(model_dir, num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=64,
                         overlap_output_processing=overlap)  # fmt: skip
    expected: dict[str, int] = {}
    finished: dict[str, RequestOutput] = {}
    for i in range(40):
        max_tokens = rng.randint(1, 12)
        engine.add_request(f"r{i}", random_prompt(rng, rng.randint(1, 120)), greedy(max_tokens),
                           priority=rng.randint(0, 2))  # fmt: skip
        expected[f"r{i}"] = max_tokens
        if rng.random() < 0.25:
            victim = f"r{rng.randrange(i + 1)}"
            engine.abort(victim)  # a no-op when it already finished
            if victim not in finished:
                expected.pop(victim, None)
        for out in engine.step():
            assert out.request_id in expected and out.request_id not in finished
            if out.finished:
                finished[out.request_id] = out
        stats = engine.stats()
        assert stats.num_running <= 6
        assert stats.num_kv_blocks_used + stats.num_kv_blocks_free == 24
    finished.update({o.request_id: o for o in sum(run_all(engine).values(), []) if o.finished})
    assert {r: len(o.token_ids) for r, o in finished.items()} == expected
    stats = engine.stats()
    assert stats.num_kv_blocks_used == 0 and stats.num_preemptions > 0


def test_overlap_returns_what_sync_returns_one_step_later(model_dir: Path) -> None:
    """Overlapped output processing changes when outputs arrive, never what they are."""
    rng = random.Random(5)
    prompts: list[Prompt] = [random_prompt(rng, rng.randint(2, 30)) for _ in range(6)]
    free = make_llm(model_dir).generate(prompts, greedy(12))
    params = [
        greedy(12, stop=[o.text[2:4]]) if i % 2 and len(o.text) > 4 else greedy(5 + i)
        for i, o in enumerate(free)
    ]
    results = []
    for overlap in (False, True):
        engine = make_engine(model_dir, overlap_output_processing=overlap)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", prompt, p)
        first = engine.step()
        assert (first == []) == overlap  # the first step's outputs come with the second
        outputs = {o.request_id: o for o in first}
        for outs in run_all(engine).values():
            outputs[outs[-1].request_id] = outs[-1]
        results.append({r: (o.token_ids, o.text, o.finish_reason) for r, o in outputs.items()})
        assert engine.stats().num_kv_blocks_used == 0
    assert results[0] == results[1]
    assert any(reason == "stop" for _, _, reason in results[1].values())
