"""logit_bias, presence/frequency penalties and grammar masks in the sampler."""

from __future__ import annotations

import pytest
import torch

from workers.engine.grammar import StepMasks, bitmask_to_allowed
from workers.engine.logit_adjustments import adjust_logits
from workers.engine.sampler import Sampler
from workers.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def bitmask_allowing(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """xgrammar's layout built by hand: bit t % 32 of word t // 32 set when t is allowed."""
    words = -(-vocab // 32)
    mask = torch.zeros(len(allowed), words, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            word = int(mask[row, t // 32])
            bit = 1 << (t % 32)
            # Bit 31 is the sign bit of an int32 word.
            value = word | bit
            mask[row, t // 32] = value - (1 << 32) if value >= 1 << 31 else value
    return mask


def test_bitmask_unpacks_to_the_allowed_tokens() -> None:
    """Every bit position, the sign bit included, maps to its token id."""
    vocab = 70
    rows = [{0, 31, 32, 63, 69}, set(range(vocab))]
    allowed = bitmask_to_allowed(bitmask_allowing(rows, vocab), vocab)
    assert allowed.shape == (2, vocab)
    assert set(allowed[0].nonzero().flatten().tolist()) == rows[0]
    assert bool(allowed[1].all())


def test_masked_rows_pick_only_allowed_tokens_whatever_the_sampling() -> None:
    """Greedy, temperature, top-k and top-p all choose among the allowed tokens only."""
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 5
    allowed = [{7}, {3, 4}, {10, 20, 30}, {49}]
    masks = StepMasks(rows=[0, 1, 2, 3], bitmask=bitmask_allowing(allowed, vocab))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=1),
              SamplingParams(temperature=1.0, top_k=2, seed=2),
              SamplingParams(temperature=0.7, top_p=0.5, seed=3)]
    sampler = Sampler(0, CPU)
    for step in range(20):
        tokens = sampler.sample(logits, params, [step] * 4, masks=masks)
        for token, ok in zip(tokens, allowed, strict=True):
            assert token.token_id in ok


def test_unmasked_rows_are_untouched_by_another_rows_mask() -> None:
    """Only the rows named in the masks change."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    masks = StepMasks(rows=[1], bitmask=bitmask_allowing([{2}], 3))
    out = adjust_logits(logits, [SamplingParams(), SamplingParams()], None, masks)
    assert out[0].tolist() == [0.0, 5.0, 1.0]
    assert out[1].tolist() == [float("-inf"), float("-inf"), 1.0]
    assert logits[1].tolist() == [0.0, 5.0, 1.0]  # the caller's logits are not changed


def test_logit_bias_adds_per_row_and_can_ban_a_token() -> None:
    """OpenAI's logit_bias: added to that row's logit; -100 keeps greedy off a token."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = [SamplingParams(temperature=0, logit_bias={1: -100.0, 2: 0.5}),
              SamplingParams(temperature=0)]
    out = adjust_logits(logits, params, None, None)
    assert out.tolist() == [[0.0, -95.0, 1.5], [0.0, 5.0, 1.0]]
    tokens = Sampler(0, CPU).sample(logits, params, [0, 0])
    assert [t.token_id for t in tokens] == [2, 1]


def test_penalties_follow_openai_formula() -> None:
    """logit -= frequency * count + presence * (count > 0), per row, from its own tokens."""
    logits = torch.zeros(3, 4)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
              SamplingParams(),
              SamplingParams(presence_penalty=-2.0)]
    outputs = [[1, 1, 1, 3], [1, 2], []]
    out = adjust_logits(logits, params, outputs, None)
    assert out[0].tolist() == pytest.approx([0.0, -(0.5 * 3 + 1.0), 0.0, -(0.5 + 1.0)])
    assert out[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # no penalty: its tokens don't count
    assert out[2].tolist() == [0.0, 0.0, 0.0, 0.0]  # nothing generated yet


def test_frequency_penalty_moves_greedy_off_a_repeated_token() -> None:
    """Through the sampler: a strong enough penalty changes the greedy pick."""
    logits = torch.tensor([[0.0, 2.0, 1.5]])
    params = [SamplingParams(temperature=0, frequency_penalty=0.3)]
    sampler = Sampler(0, CPU)
    assert sampler.sample(logits, params, [1], output_token_ids=[[1]])[0].token_id == 1
    assert sampler.sample(logits, params, [2], output_token_ids=[[1, 1]])[0].token_id == 2


def test_penalties_need_the_output_tokens() -> None:
    """A caller that forgets the output tokens is told, not silently unpenalised."""
    with pytest.raises(ValueError, match="output token ids"):
        adjust_logits(torch.zeros(1, 3), [SamplingParams(presence_penalty=1.0)], None, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("logit_bias", {1: 101.0})],
)
def test_out_of_range_adjustments_are_refused(field: str, value: object) -> None:
    """The engine's own check of OpenAI's ranges."""
    with pytest.raises(ValueError, match=field.split("_")[0]):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
