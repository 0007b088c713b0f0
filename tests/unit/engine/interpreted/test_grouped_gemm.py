"""The experts' Triton grouped GEMM against the dense reference, under the interpreter."""

from __future__ import annotations

import pytest
import torch

from workers.engine.kernels.grouped_gemm import align_pairs, grouped_gemm
from workers.engine.kernels.moe_reference import moe_reference
from workers.engine.models.experts import experts_grouped, experts_triton, route

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _case(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
          dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, -1] -= 100.0  # the last expert is never chosen: a run of length zero
    weights, ids = route(logits, top_k, renormalize=True)
    return x, w13, w2, ids, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter"), [
    (1, 4, 2, 32, 48),     # a decode: two experts of one token
    (7, 8, 2, 40, 24),     # sizes off the tile grid on both matmul dimensions
    (70, 4, 1, 64, 80),    # a prefill where one expert gets more than a 64-row tile
    (33, 16, 4, 32, 32),   # more experts than tiles of work
])
def test_triton_experts_equal_the_dense_reference(
    dtype: torch.dtype, num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int
) -> None:
    x, w13, w2, ids, weights = _case(num_tokens, num_experts, top_k, hidden, inter, dtype)
    expected = moe_reference(x, w13, w2, ids, weights).float()
    got = experts_triton(x, w13, w2, ids, weights).float()
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    grouped = experts_grouped(x, w13, w2, ids, weights).float()
    torch.testing.assert_close(grouped, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_planted_bug_in_the_expert_choice_is_caught() -> None:
    """The check can fail: rows multiplied by the wrong expert's weight differ."""
    x, w13, w2, ids, weights = _case(9, 4, 2, 32, 32, torch.float32)
    sorted_ids, block_experts = align_pairs(ids, 4, 16)
    wrong = torch.where(block_experts >= 0, (block_experts + 1) % 4, block_experts)
    h = grouped_gemm(x, w13, sorted_ids, wrong.to(torch.int32), num_pairs=18,
                     rows_per_a_row=2, block_m=16)
    right = grouped_gemm(x, w13, sorted_ids, block_experts, num_pairs=18,
                         rows_per_a_row=2, block_m=16)
    assert not torch.allclose(h, right)
