"""The steps and seconds the engine needs for what it holds (workers.engine.work_left)."""

from __future__ import annotations

import pytest

from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence as Seq
from workers.engine.work_left import (
    SHAPE_WINDOW,
    FinishedShape,
    full_batch_tokens_per_s,
    live_work_left,
    num_steps_left,
    seconds_left,
)


def test_the_docstring_example() -> None:
    assert num_steps_left([3, 1], [2, 2], max_num_seqs=2) == 5


def test_a_wave_wider_than_the_batch_leaves_a_narrow_tail() -> None:
    """300 requests of 32 outputs on 256 slots: 32 full steps, then 44 requests for 32
    more; on 300 slots, 32 steps."""
    assert num_steps_left([], [32] * 300, max_num_seqs=256) == 64
    assert num_steps_left([], [32] * 300, max_num_seqs=300) == 32
    # Running ones near their end free slots early: 256 with 2 left, 44 waiting.
    assert num_steps_left([2] * 256, [32] * 44, max_num_seqs=256) == 34
    assert num_steps_left([], [], max_num_seqs=4) == 0
    with pytest.raises(ValueError, match="max_num_seqs"):
        num_steps_left([1], [], max_num_seqs=0)


def test_the_per_step_cost_is_what_makes_the_tail_slow() -> None:
    """0.3 s a step and 5 ms a sequence-step (SmolLM2 on two cores, roughly): the 64
    steps of 300 x 32 outputs on 256 slots take 64 x 0.3 + 9,600 x 0.005 = 67.2 s; on
    300 slots 32 x 0.3 + 48 = 57.6 s."""
    coefficients = (0.3, 0.0, 0.0, 0.005)
    assert seconds_left(num_steps=64, num_tokens=9600, num_kv_reads=0, num_seq_steps=9600,
                        coefficients=coefficients) == pytest.approx(67.2)
    assert seconds_left(num_steps=32, num_tokens=9600, num_kv_reads=0, num_seq_steps=9600,
                        coefficients=coefficients) == pytest.approx(57.6)
    assert seconds_left(num_steps=1, num_tokens=1000, num_kv_reads=100_000, num_seq_steps=0,
                        coefficients=(0.0, 1e-4, 1e-6, 0.0)) == pytest.approx(0.2)


def test_a_step_alone_reads_the_mean_context_left() -> None:
    """One request of 10 tokens with 4 outputs left reads 10 + 11 + 12 + 13 = 46 KV
    positions over its 4 steps: a step alone reads 11.5 (12) of them: 0.3 + 1e-4 + 12 x
    1e-6 + 0.005 s."""
    seq = Seq("r", list(range(10)), SamplingParams(max_tokens=4))
    left = live_work_left([(seq, False)], cached_share=0.0, max_model_len=100,
                          max_num_seqs=8, coefficients=(0.3, 1e-4, 1e-6, 0.005))
    assert left["solo_step_seconds"] == pytest.approx(0.3 + 1e-4 + 12e-6 + 0.005)
    none = live_work_left([(seq, False)], cached_share=0.0, max_model_len=100,
                          max_num_seqs=8, coefficients=None)
    assert none["solo_step_seconds"] is None


def test_a_full_batch_of_jobs_shaped_as_the_finished_ones() -> None:
    """The docstring example: 1,550 tokens/s; the per-step cost is shared by the batch."""
    shape = FinishedShape()
    assert full_batch_tokens_per_s(shape, max_num_seqs=256,
                                   coefficients=(0.1, 5e-4, 0.0, 1e-4)) is None
    shape.add(prompt_tokens=40, cached_tokens=20, output_tokens=8)
    pace = full_batch_tokens_per_s(shape, max_num_seqs=256, coefficients=(0.1, 5e-4, 0.0, 1e-4))
    assert pace == pytest.approx(27 / (8 * 0.1 / 256 + 27 * 5e-4 + 8 * 1e-4))
    assert pace == pytest.approx(1550, rel=1e-3)
    narrow = full_batch_tokens_per_s(shape, max_num_seqs=8, coefficients=(0.1, 5e-4, 0.0, 1e-4))
    assert pace is not None and narrow is not None and narrow < pace / 5
    # Context reads: 8 outputs over a 40-token prompt read 8 x 40 + 28 positions.
    with_kv = full_batch_tokens_per_s(shape, max_num_seqs=256, coefficients=(0.0, 0.0, 1e-6, 0.0))
    assert with_kv == pytest.approx(27 / (348 * 1e-6))


def test_the_shape_follows_the_recent_requests() -> None:
    """A plain mean over the first SHAPE_WINDOW, then each new one weighs 1/SHAPE_WINDOW."""
    shape = FinishedShape()
    shape.add(prompt_tokens=100, cached_tokens=100, output_tokens=10)  # all cached: 1 runs
    shape.add(prompt_tokens=50, cached_tokens=0, output_tokens=30)
    assert (shape.prompt_tokens, shape.computed_prompt_tokens, shape.output_tokens) == (
        pytest.approx(75), pytest.approx(25.5), pytest.approx(20))
    for _ in range(10 * SHAPE_WINDOW):
        shape.add(prompt_tokens=10, cached_tokens=0, output_tokens=2)
    assert shape.prompt_tokens == pytest.approx(10, rel=1e-3)
    assert shape.output_tokens == pytest.approx(2, rel=1e-3)


def test_the_work_left_carries_the_full_batch_pace_once_the_cost_is_fitted() -> None:
    shape = FinishedShape()
    shape.add(prompt_tokens=40, cached_tokens=20, output_tokens=8)
    fitted = live_work_left([], cached_share=0.0, max_model_len=100, max_num_seqs=256,
                            coefficients=(0.1, 5e-4, 0.0, 1e-4), finished=shape)
    assert fitted["num_requests_left"] == 0
    assert fitted["full_batch_tokens_per_s"] == pytest.approx(1550, rel=1e-3)
    unfitted = live_work_left([], cached_share=0.0, max_model_len=100, max_num_seqs=256,
                              coefficients=None, finished=shape)
    assert unfitted["full_batch_tokens_per_s"] is None
