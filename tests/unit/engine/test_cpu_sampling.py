"""The CPU kernels that draw a token over the whole vocabulary, or take each row's greedy
token, against the torch rule."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.test_sampler import (
    TINY_TEMPERATURES,
    tiny_temperature_logits,
    tokens_at,
)
from workers.engine import cpu_kernels
from workers.engine.sampler import Sampler, _inverse_cdf, seeded_uniform
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is not None, reason=f"CPU kernels unavailable: {cpu_kernels.load()}"
)


def draw(scores: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor,
         uniforms: torch.Tensor) -> torch.Tensor:
    return torch.ops.batchinfer_cpu.draw_tokens(scores, rows, scales, uniforms)


def torch_rule(scores: torch.Tensor, scales: torch.Tensor,
               uniforms: torch.Tensor) -> torch.Tensor:
    """The sampler's torch path: softmax of the scaled scores, then `_inverse_cdf`."""
    return _inverse_cdf(torch.softmax(scores * scales[:, None], dim=-1), uniforms)


@pytest.mark.parametrize("vocab", [1, 7, 255, 256, 257, 1000, 49_152])
def test_each_draw_is_the_torch_rules(vocab: int) -> None:
    """Masked (-inf) tokens, per-row temperatures, vocabularies around the scan's block:
    the same token as softmax, cumulative sum and search, row by row."""
    gen = torch.Generator().manual_seed(vocab)
    scores = torch.randn(64, vocab, generator=gen) * 3
    scores[:, 1::7] = float("-inf")
    scales = torch.rand(64, generator=gen) + 0.5
    uniforms = torch.rand(64, generator=gen)
    tokens = draw(scores, torch.arange(64), scales, uniforms)
    assert tokens.tolist() == torch_rule(scores, scales, uniforms).tolist()
    assert bool(torch.isfinite(scores[torch.arange(64), tokens]).all())


def test_rows_are_picked_by_index_and_may_repeat() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(5, 300, generator=gen)
    rows = torch.tensor([4, 0, 4, 2])
    scales = torch.tensor([1.0, 2.0, 0.5, 1.0])
    uniforms = torch.tensor([0.1, 0.5, 0.9, 0.3])
    assert draw(scores, rows, scales, uniforms).tolist() == torch_rule(
        scores[rows], scales, uniforms).tolist()


def test_a_uniform_past_every_boundary_takes_the_last_token_with_weight() -> None:
    """Rounding can leave no token whose cumulative weight exceeds u x total: the last
    token with weight is drawn, never a masked one after it."""
    scores = torch.full((2, 600), float("-inf"))
    scores[0, :300] = 0.0
    scores[1, 17] = 5.0  # one token with weight: drawn whatever the uniform
    tokens = draw(scores, torch.arange(2), torch.ones(2), torch.tensor([1.0, 0.999]))
    assert tokens.tolist() == [299, 17]
    assert draw(scores, torch.tensor([1]), torch.ones(1), torch.zeros(1)).tolist() == [17]


def test_bad_arguments_are_refused() -> None:
    scores = torch.zeros(2, 10)
    ones = torch.ones(2)
    with pytest.raises(RuntimeError, match="float32"):
        draw(scores.double(), torch.arange(2), ones, ones)
    with pytest.raises(RuntimeError, match="outside the scores"):
        draw(scores, torch.tensor([0, 2]), ones, ones)
    with pytest.raises(RuntimeError, match="one per row"):
        draw(scores, torch.arange(2), torch.ones(3), ones)


def test_the_sampler_draws_plain_rows_with_it_and_keeps_seeds_row_bound() -> None:
    """Temperature-only rows go through the kernel: a seeded row draws what the torch rule
    draws with its seeded uniform, whatever else shares the batch."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 2000, generator=gen) * 2
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(6)]
    tokens = [t.token_id for t in Sampler(0, torch.device("cpu")).sample(
        logits, params, [9] * 6)]
    uniforms = torch.tensor([seeded_uniform(i, 9) for i in range(6)])
    assert tokens == torch_rule(logits, torch.full((6,), 1 / 0.8), uniforms).tolist()


def test_total_weights_are_the_torch_sums() -> None:
    """The nucleus's mass over the whole vocabulary: exp((s - top) x scale) summed per row,
    masked tokens adding nothing."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(9, 3000, generator=gen) * 4
    scores[:, ::5] = float("-inf")
    scales = torch.rand(9, generator=gen) + 0.5
    tops = scores.amax(dim=-1)
    got = torch.ops.batchinfer_cpu.total_weights(scores, scales, tops)
    want = torch.exp((scores - tops[:, None]) * scales[:, None]).sum(dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    with pytest.raises(RuntimeError, match="one per row"):
        torch.ops.batchinfer_cpu.total_weights(scores, scales[:3], tops)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 2048, 49_152])
def test_greedy_tokens_are_torch_argmax(vocab: int) -> None:
    """Ties go to the first maximum, a NaN wins (the first one), a row all -inf or all
    +inf takes token 0; strided rows (a slice of a wider matrix) read right."""
    gen = torch.Generator().manual_seed(vocab)
    scores = torch.randn(40, vocab + 3, generator=gen)[:, :vocab]
    scores[1] = 0.0
    scores[2] = float("-inf")
    scores[3] = float("inf")
    scores[4, vocab // 2] = float("nan")
    scores[4, vocab - 1] = float("nan")
    scores[5, vocab // 3] = scores[5, vocab - 1] = scores[5].max() + 1
    scores[6, ::2] = float("-inf")
    got = torch.ops.batchinfer_cpu.greedy_tokens(scores)
    assert got.dtype == torch.int64
    assert got.tolist() == scores.argmax(dim=-1).tolist()


def test_the_sampler_takes_greedy_rows_from_the_kernel_beside_drawn_ones() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 3000, generator=gen)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=2),
              SamplingParams(temperature=0)]
    tokens = [t.token_id for t in Sampler(0, torch.device("cpu")).sample(
        logits, params, [0] * 5)]
    greedy = logits.argmax(dim=-1).tolist()
    assert [tokens[i] for i in (0, 2, 4)] == [greedy[i] for i in (0, 2, 4)]
    uniforms = torch.tensor([seeded_uniform(1, 0), seeded_uniform(2, 0)])
    assert [tokens[1], tokens[3]] == torch_rule(
        logits[[1, 3]], torch.full((2,), 1 / 0.7), uniforms).tolist()


EXTREME_SCALES = [1e8, 1e20, 1e30, torch.finfo(torch.float32).max, float("inf")]


@pytest.mark.parametrize("scale", EXTREME_SCALES)
def test_an_extreme_scale_draws_the_best_token(scale: float) -> None:
    """1/T for T from 1e-8 down past float32's range: each row's best token, whatever the
    uniform (tied best tokens share the draw), and a total weight of one per best token.
    Before, s x scale - max lost the best token's weight to rounding (the last token was
    drawn) or made NaN of it."""
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(6, 49_152, generator=gen) * 3 + 20
    scores[5, [100, 40_000]] = scores[5].max() + 1  # a tie at the best
    best = scores.argmax(dim=-1)
    scales = torch.full((6,), scale)
    for u in (0.0, 0.5, 1 - 2**-24):
        tokens = draw(scores, torch.arange(6), scales, torch.full((6,), u))
        assert tokens[:5].tolist() == best[:5].tolist()
        assert tokens[5].item() == (100 if u < 0.5 else 40_000)
    totals = torch.ops.batchinfer_cpu.total_weights(scores, scales, scores.amax(dim=-1))
    assert totals.tolist() == [1.0] * 5 + [2.0]


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_tiny_temperature_takes_the_greedy_token_beside_the_kernels(
        temperature: float) -> None:
    """The CPU sampling path (test_sampler has the torch one): the temperature-0 token,
    seeded or not, whatever the filters; before, the kernel drew token 0, the last token
    or a near tie's runner-up."""
    logits = tiny_temperature_logits(temperature)
    assert tokens_at(logits, temperature) == tokens_at(logits, 0.0)
    assert tokens_at(logits, 0.0) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1e-8, 1e-20, 1e-45])
def test_the_kernel_draw_takes_the_best_token_at_tiny_temperatures(
        temperature: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The draw itself, with the greedy bound out of the way: the best token of each row
    of large logits, by the kernels (plain rows) or the candidates and the kernel's total
    weight (filtered rows). Before, rounding left no weight in about one plain row in six
    at 1e-8, and 1e-45 made NaN weights."""
    monkeypatch.setattr(SamplingParams, "is_greedy",
                        property(lambda params: params.temperature == 0))
    # No near ties: the best is clear.
    logits = tiny_temperature_logits(temperature, num_rows=128)[:64]
    assert tokens_at(logits, temperature) == logits.argmax(dim=-1).tolist()
