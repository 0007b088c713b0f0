"""Sampling: greedy, temperature, top-k, top-p, logprobs, and seeds that ignore the batch."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from core.greedy import GREEDY_TEMPERATURE
from tests.unit.engine.checkpoints import make_seq, place, save_llama
from workers.engine import sampler as sampler_module
from workers.engine.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.engine.sampler import Sampler, _pick_in_vocabulary, seeded_uniform
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

CPU = torch.device("cpu")


def draw(
    logits: torch.Tensor, params: SamplingParams, num_draws: int, seed: int = 0
) -> Counter[int]:
    """Token counts over num_draws unseeded draws from one row (batched as num_draws rows)."""
    sampler = Sampler(seed, CPU)
    rows = logits.expand(num_draws, -1).contiguous()
    tokens = sampler.sample(rows, [params] * num_draws, [0] * num_draws)
    return Counter(t.token_id for t in tokens)


def test_greedy_is_argmax_and_first_on_ties() -> None:
    """temperature 0 takes the most likely token; the lowest id wins a tie."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 0.0, 4.9]])
    greedy = SamplingParams(temperature=0)
    tokens = Sampler(0, CPU).sample(logits, [greedy, greedy], [0, 5])
    assert [t.token_id for t in tokens] == [1, 0]
    assert all(t.logprob is None for t in tokens)


def test_logprobs_are_those_of_the_model_distribution() -> None:
    """The sampled token's log-probability under softmax(logits), only when asked."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0, logprobs=True),
        SamplingParams(temperature=0.7, logprobs=True, seed=3),
        SamplingParams(temperature=0),
    ]
    tokens = Sampler(0, CPU).sample(logits, params, [0, 0, 0])
    expected = torch.log_softmax(logits, -1)
    for row in (0, 1):
        lp = tokens[row].logprob
        assert lp is not None
        assert math.isclose(lp, float(expected[row, tokens[row].token_id]), abs_tol=1e-5)
    assert tokens[2].logprob is None


def test_top_logprobs_are_the_most_likely_tokens_of_each_row() -> None:
    """Each row's own count of alternatives, best first, under softmax(logits); rows that
    asked for none (or no logprobs) get none."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.9, seed=2, logprobs=True, top_logprobs=20),
        SamplingParams(temperature=0, logprobs=True),
        SamplingParams(temperature=0),
    ]
    tokens = Sampler(0, CPU).sample(logits, params, [0, 0, 0, 0])
    expected = torch.log_softmax(logits, -1)
    for row, k in ((0, 3), (1, 20)):
        top = tokens[row].top_logprobs
        assert top is not None and len(top) == k
        values, ids = expected[row].topk(k)
        assert [t for t, _ in top] == ids.tolist()
        for (_, lp), v in zip(top, values, strict=True):
            assert math.isclose(lp, float(v), abs_tol=1e-5)
    assert tokens[0].top_logprobs[0][0] == tokens[0].token_id  # type: ignore[index]
    assert tokens[2].top_logprobs is None and tokens[3].top_logprobs is None
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        SamplingParams(top_logprobs=2)
    with pytest.raises(ValueError, match="top_logprobs must be in"):
        SamplingParams(logprobs=True, top_logprobs=21)


def test_temperature_sampling_follows_the_softmax() -> None:
    """Frequencies over many draws match softmax(logits / T) within sampling noise."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    counts = draw(logits, SamplingParams(temperature=0.8), 20000)
    probs = torch.softmax(logits[0] / 0.8, -1)
    for token in range(4):
        freq = counts[token] / 20000
        sigma = math.sqrt(float(probs[token]) * (1 - float(probs[token])) / 20000)
        assert abs(freq - float(probs[token])) < 5 * sigma + 1e-3
    assert counts[4] == 0  # ~1e-17: never drawn


def test_top_k_keeps_only_the_k_best() -> None:
    """Only the k most likely tokens are ever drawn, each of them sometimes."""
    logits = torch.tensor([[0.5, 0.4, 0.3, 0.2, 0.1, 0.0]])
    counts = draw(logits, SamplingParams(temperature=1.0, top_k=3), 4000)
    assert set(counts) == {0, 1, 2}
    top1 = draw(logits, SamplingParams(temperature=5.0, top_k=1), 200)
    assert set(top1) == {0}
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=100), 4000)) == set(range(6))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    """top_p 0.6 over probs (0.5, 0.3, 0.15, 0.05) keeps the first two; tiny top_p the best."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    counts = draw(logits, SamplingParams(temperature=1.0, top_p=0.6), 4000)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 4000 - 0.5 / 0.8) < 0.05
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.01), 200)) == {0}
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.85), 4000)) == {0, 1, 2}


def test_top_k_and_top_p_combine_per_row() -> None:
    """Rows of one batch keep their own filters."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).expand(3, -1).contiguous()
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, top_k=2, top_p=0.99),
    ]
    sampler = Sampler(0, CPU)
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(300):
        for row, token in enumerate(sampler.sample(logits, params, [0, 0, 0])):
            seen[row].add(token.token_id)
    assert seen == [{0}, {0}, {0, 1}]


def test_seeded_rows_ignore_batch_composition() -> None:
    """A seeded row draws the same token alone, in any position, beside any other rows."""
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, 1000, generator=gen)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler(0, CPU).sample(row, [params], [3])[0].token_id
    for size, position, sampler_seed in [(2, 0, 1), (5, 4, 2), (9, 3, 3)]:
        batch = torch.randn(size, 1000, generator=gen)
        batch[position] = row[0]
        others = [SamplingParams(temperature=0.5, top_k=5)] * size
        others[position] = params
        steps = [7] * size
        steps[position] = 3
        tokens = Sampler(sampler_seed, CPU).sample(batch, others, steps)
        assert tokens[position].token_id == alone


def test_seeded_uniforms_depend_on_seed_and_step_only() -> None:
    """Deterministic, in [0, 1), different across seeds and steps."""
    values = {seeded_uniform(seed, step) for seed in range(20) for step in range(20)}
    assert len(values) == 400
    assert all(0.0 <= u < 1.0 for u in values)
    assert seeded_uniform(5, 6) == seeded_uniform(5, 6)


def generate(runner: ModelRunner, seqs: list[Sequence], max_tokens: int) -> list[list[int]]:
    """A minimal engine loop: prefill each sequence whole, then decode all together."""
    place(seqs, [s.num_tokens + max_tokens for s in seqs], runner.block_size)
    counts = [s.num_tokens for s in seqs]
    for _ in range(max_tokens):
        sampled = runner.execute(seqs, counts)
        for seq, n, token in zip(seqs, counts, sampled, strict=True):
            assert token is not None
            seq.num_computed_tokens += n
            seq.append_token(token.token_id, token.logprob)
        counts = [1] * len(seqs)
    return [s.output_token_ids for s in seqs]


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    """A tiny random Llama on CPU."""
    path = tmp_path_factory.mktemp("llama")
    save_llama(path, initializer_range=0.2)
    return ModelRunner(
        EngineConfig(model=str(path), device="cpu", block_size=16, num_kv_blocks=256)
    )


def test_seeded_generation_is_reproducible_across_batches(runner: ModelRunner) -> None:
    """The same seeded request alone and inside two different batches: identical tokens."""
    prompt = list(range(10, 50))
    seeded = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}
    alone = generate(runner, [make_seq(prompt, "x", **seeded)], 12)[0]
    batch_a = [make_seq(list(range(3, 90)), "a", temperature=1.0)]
    batch_a.append(make_seq(prompt, "x", **seeded))
    batch_b = [make_seq([5] * n, f"b{n}", temperature=0.9, top_k=4) for n in (1, 33, 70)]
    batch_b.insert(2, make_seq(prompt, "x", **seeded))
    assert generate(runner, batch_a, 12)[1] == alone
    assert generate(runner, batch_b, 12)[2] == alone
    other_seed = generate(runner, [make_seq(prompt, "y", **{**seeded, "seed": 99})], 12)[0]
    assert other_seed != alone


def _peaked_logits(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows shaped like a language model's: a long tail and a few strong tokens."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    logits[:, :40] += torch.randn(num_rows, 40, generator=gen) * 3 + 8
    return logits[:, torch.randperm(vocab, generator=gen)].contiguous()


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_filtered_rows_draw_what_the_whole_vocabulary_draws(temperature: float) -> None:
    """Top-k and nucleus rows are drawn among their best candidates, or again over the
    whole vocabulary where their filters do not fit (a wide nucleus at a high
    temperature): for every row and uniform, the token the whole-vocabulary draw takes."""
    logits = _peaked_logits(48, 6000, seed=int(temperature * 10))
    filters: list[dict[str, Any]] = [
        {"top_p": 0.9}, {"top_p": 0.5}, {"top_p": 0.999}, {"top_k": 1}, {"top_k": 40},
        {"top_k": 300}, {"top_k": 5000}, {"top_k": 40, "top_p": 0.8}]
    params = [SamplingParams(temperature=temperature, seed=row, **filters[row % len(filters)])
              for row in range(48)]
    steps = list(range(48))
    tokens = [t.token_id for t in Sampler(0, CPU).sample(logits, params, steps)]
    uniforms = torch.tensor([seeded_uniform(row, row) for row in range(48)])
    expected = _pick_in_vocabulary(logits / temperature, params, uniforms).tolist()
    assert tokens == expected


def test_a_tie_at_the_kth_score_past_the_candidates_keeps_every_tied_token() -> None:
    """All 1,000 scores equal: top_k 3 keeps them all (ties at the k-th stay), so draws
    spread over the whole vocabulary, past any candidate list."""
    counts = draw(torch.zeros(1, 1000), SamplingParams(temperature=1.0, top_k=3), 4000)
    assert len(counts) > 900 and max(counts) > 900


def test_a_nucleus_wider_than_every_candidate_list_is_drawn_over_the_vocabulary() -> None:
    """A flat row of 10,000 tokens: top_p 0.9 keeps ~9,000 of them."""
    counts = draw(torch.zeros(1, 10_000), SamplingParams(temperature=1.0, top_p=0.9), 4000)
    assert len(counts) > 3000 and max(counts) > 8000


# Below GREEDY_TEMPERATURE, down to 1e-45, whose 1/T overflows float32.
TINY_TEMPERATURES = [1e-6, 1e-8, 1e-20, 1e-45]
FILTERS: list[dict[str, Any]] = [{}, {"top_k": 50}, {"top_p": 0.9}, {"top_k": 5, "top_p": 0.5}]


def tiny_temperature_logits(temperature: float, num_rows: int = 32,
                            vocab: int = 1000) -> torch.Tensor:
    """Rows a draw at `temperature` gets wrong or takes apart from greedy: the first half
    a model's with large logits, whose scaled values lose the best token to rounding or
    overflow; the second with a runner-up `temperature` / 2 below the best (float32's
    smallest normal gap where that is 0), before it in token order: at that temperature
    a draw takes it about one time in three."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    half = num_rows // 2
    logits[:half] += 20
    logits[half:] -= 20
    for row in range(half, num_rows):
        first, second = sorted(torch.randperm(vocab, generator=gen)[:2].tolist())
        logits[row, second] = 0.0
        logits[row, first] = -max(temperature / 2, torch.finfo(torch.float32).tiny)
    return logits


def tokens_at(logits: torch.Tensor, temperature: float) -> list[int]:
    """One batch at `temperature`: rows seeded and not, with each of FILTERS in turn."""
    params = [SamplingParams(temperature=temperature, seed=row if row % 2 else None,
                             **FILTERS[row % len(FILTERS)]) for row in range(len(logits))]
    steps = list(range(len(logits)))
    return [t.token_id for t in Sampler(0, CPU).sample(logits, params, steps)]


def test_temperatures_below_the_bound_are_greedy() -> None:
    assert all(SamplingParams(temperature=t).is_greedy
               for t in [0.0, *TINY_TEMPERATURES, GREEDY_TEMPERATURE * 0.99])
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_tiny_temperature_takes_the_greedy_token(temperature: float,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On the torch path (the CPU kernels' in test_cpu_sampling): the temperature-0 token,
    seeded or not, whatever the filters; before, 1e-45 drew from NaNs and near ties drew
    the runner-up."""
    monkeypatch.setattr(sampler_module, "_draws_in_kernel", lambda: False)
    logits = tiny_temperature_logits(temperature)
    assert tokens_at(logits, temperature) == tokens_at(logits, 0.0)
    assert tokens_at(logits, 0.0) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1e-39, 1e-45])
def test_the_torch_draw_stays_finite_where_one_over_t_overflows(
        temperature: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The draw itself, with the greedy bound out of the way: logits / T overflowed to inf
    and softmax made NaN of it; shifted by the best logit first, only the best has weight."""
    monkeypatch.setattr(sampler_module, "_draws_in_kernel", lambda: False)
    monkeypatch.setattr(SamplingParams, "is_greedy",
                        property(lambda params: params.temperature == 0))
    logits = tiny_temperature_logits(temperature)[:16]  # no near ties: the best is clear
    assert tokens_at(logits, temperature) == logits.argmax(dim=-1).tolist()


def test_tiny_temperatures_generate_the_greedy_text(runner: ModelRunner) -> None:
    """One batch, one prompt, every tiny temperature beside 0 (seeded or not): one text."""
    prompt = list(range(10, 50))
    seqs = [make_seq(prompt, "greedy", temperature=0.0)]
    seqs += [make_seq(prompt, f"t{i}", temperature=t, seed=i if i % 2 else None)
             for i, t in enumerate(TINY_TEMPERATURES)]
    outputs = generate(runner, seqs, 8)
    assert all(out == outputs[0] for out in outputs[1:])
