"""The work the engine's live requests have left, as `stats()` reports it for the ETAs."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tests.unit.engine.test_engine import greedy, make_engine, random_prompt
from tests.unit.engine.tiny_models import save_tiny_llama
from workers.engine.work_left import full_batch_tokens_per_s


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-work-left")
    save_tiny_llama(path, seed=7)
    return path


def test_work_left_counts_down_to_what_the_model_computes(model_dir: Path) -> None:
    """Three requests of 20-token prompts and 8 output tokens: 3 x (20 + 7) tokens to
    compute before the first step (the last output token is never fed back); each step
    then takes away exactly the tokens it computed, and nothing is left at the end."""
    engine = make_engine(model_dir, max_num_seqs=2)  # the third waits: a second wave
    rng = random.Random(3)
    for i in range(3):
        engine.add_request(f"r{i}", random_prompt(rng, 20), greedy(8))
    stats = engine.stats()
    assert (stats.num_requests_left, stats.num_tokens_to_compute,
            stats.num_output_tokens_left) == (3, 3 * 27, 3 * 8)
    while engine.has_unfinished_requests():
        before = engine.stats()
        engine.step()
        after = engine.stats()
        computed = after.num_computed_tokens - before.num_computed_tokens
        assert before.num_tokens_to_compute - after.num_tokens_to_compute == computed
        generated = after.num_generated_tokens - before.num_generated_tokens
        assert before.num_output_tokens_left - after.num_output_tokens_left == generated
    stats = engine.stats()
    assert (stats.num_requests_left, stats.num_tokens_to_compute,
            stats.num_output_tokens_left) == (0, 0, 0)


def test_an_aborted_request_leaves_no_work(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    rng = random.Random(4)
    engine.add_request("kept", random_prompt(rng, 10), greedy(4))
    engine.add_request("dropped", random_prompt(rng, 30), greedy(50))
    engine.step()
    engine.abort("dropped")
    stats = engine.stats()
    assert stats.num_requests_left == 1
    assert stats.num_output_tokens_left == 3  # the prefill step produced the first token
    assert stats.num_tokens_to_compute == 3  # the last sampled token, then two more
    # The 1 s gauges read the load without the sum over live requests.
    load_only = engine.stats(work_left=False)
    assert load_only.num_running == stats.num_running and load_only.num_requests_left == 0


def test_a_waiting_prompt_counts_less_the_share_admitted_ones_found_cached(
        model_dir: Path) -> None:
    """Lines sharing a 48-token prefix (a chat template, a system prompt): the first
    computes its 64 prompt tokens, the second finds 48 of them cached. With 48 of 128
    admitted prompt tokens found cached, a third, still waiting, is expected to compute
    64 - int(0.375 x 64) = 40 of its prompt, then 3 more for its 4 output tokens."""
    engine = make_engine(model_dir, max_num_seqs=1)
    rng = random.Random(5)
    shared = random_prompt(rng, 48)
    engine.add_request("first", shared + random_prompt(rng, 16), greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("second", shared + random_prompt(rng, 16), greedy(4))
    engine.add_request("third", shared + random_prompt(rng, 16), greedy(4))
    engine.step()  # admits the second only (max_num_seqs=1)
    stats = engine.stats()
    # The second: its first token sampled, 3 to go (3 tokens to compute); the third: 40 + 3.
    assert stats.num_requests_left == 2
    assert stats.num_tokens_to_compute == 3 + 43


def test_loaded_time_holds_the_gaps_between_steps_while_requests_wait(
        model_dir: Path) -> None:
    """Time between two steps while a request is live counts as loaded (the caller's
    work is part of serving it); once none is, a step adds nothing."""
    engine = make_engine(model_dir)
    engine.add_request("r", random_prompt(random.Random(6), 10), greedy(3))
    engine.step()
    time.sleep(0.2)  # the caller stores results, takes requests
    engine.step()
    stats = engine.stats()
    assert stats.loaded_seconds >= stats.busy_seconds + 0.2
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.stats().loaded_seconds
    time.sleep(0.05)
    engine.step()  # nothing to run
    assert engine.stats().loaded_seconds == done


def test_once_its_step_cost_is_fitted_the_engine_predicts_the_time_left(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No prediction before the cost model has seen enough steps; after, a positive one
    that shrinks as the work is done, and none once nothing is left."""
    engine = make_engine(model_dir)
    rng = random.Random(8)
    for i in range(4):
        engine.add_request(f"r{i}", random_prompt(rng, 12), greedy(40))
    assert engine.stats().predicted_seconds_left is None
    assert engine.stats().solo_step_seconds is None
    while not engine.scheduler.cost_model.is_fitted:
        engine.step()
    first = engine.stats().predicted_seconds_left
    assert first is not None and first > 0
    # A step of one of them alone costs less than a step of all four.
    solo = engine.stats().solo_step_seconds
    coefficients = engine.scheduler.cost_model.coefficients()
    assert solo is not None and coefficients[0] <= solo < first
    # The cost stops learning here: on a loaded machine the next steps' own times could
    # raise it by more than the work they do lowers the total.
    monkeypatch.setattr(engine.scheduler.cost_model, "observe", lambda *args: None)
    for _ in range(10):
        engine.step()
    later = engine.stats().predicted_seconds_left
    assert later is not None and 0 < later < first
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().predicted_seconds_left is None


def test_holding_nothing_the_engine_prices_a_full_batch_of_jobs_like_its_last(
        model_dir: Path) -> None:
    """Four 12-token prompts of 40 outputs, run to the end: the finished shape is theirs,
    and with the fitted cost, the pace of a full batch of them (max_num_seqs at a time),
    which is that cost's own arithmetic for that shape."""
    engine = make_engine(model_dir)
    assert engine.stats().full_batch_tokens_per_s is None
    rng = random.Random(9)
    for i in range(4):
        engine.add_request(f"r{i}", random_prompt(rng, 12), greedy(40))
    while engine.has_unfinished_requests():
        engine.step()
    shape = engine.finished_shape
    assert (shape.num_finished, shape.prompt_tokens, shape.output_tokens) == (4, 12, 40)
    assert 1 <= shape.computed_prompt_tokens <= 12
    stats = engine.stats()
    assert engine.scheduler.cost_model.is_fitted and stats.num_requests_left == 0
    assert stats.full_batch_tokens_per_s == pytest.approx(full_batch_tokens_per_s(
        shape, max_num_seqs=engine.scheduler.max_num_seqs,
        coefficients=engine.scheduler.cost_model.coefficients()))
    assert stats.full_batch_tokens_per_s is not None and stats.full_batch_tokens_per_s > 0
