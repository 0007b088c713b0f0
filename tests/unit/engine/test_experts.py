"""The expert layer's routing and alignment, in plain torch."""

from __future__ import annotations

import pytest
import torch

from workers.engine.kernels.grouped_gemm import align_pairs
from workers.engine.kernels.moe_reference import moe_reference
from workers.engine.models.experts import FusedExperts, experts_grouped, route


def test_alignment_gives_every_tile_one_expert_and_every_pair_one_row() -> None:
    ids = torch.tensor([[2], [0], [2], [2], [2]])
    sorted_ids, block_experts = align_pairs(ids, num_experts=3, block_m=4)
    assert sorted_ids.tolist()[:8] == [1, 5, 5, 5, 0, 2, 3, 4]
    assert block_experts.tolist()[:2] == [0, 2]
    assert set(block_experts.tolist()[2:]) == {-1}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8, (50, 3), generator=gen)
    sorted_ids, block_experts = align_pairs(ids, num_experts=8, block_m=16)
    real = sorted_ids[sorted_ids < 150]
    assert sorted(real.tolist()) == list(range(150))
    for tile, expert in enumerate(block_experts.tolist()):
        pairs = sorted_ids[tile * 16:(tile + 1) * 16]
        pairs = pairs[pairs < 150]
        if expert < 0:
            assert pairs.numel() == 0
        else:
            assert (ids.reshape(-1)[pairs.long()] == expert).all()


def test_routing_renormalises_only_when_asked() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))


def test_grouped_experts_equal_the_dense_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(23, 32, generator=gen)
    w13 = torch.randn(6, 64, 32, generator=gen) / 6
    w2 = torch.randn(6, 32, 32, generator=gen) / 6
    weights, ids = route(torch.randn(23, 6, generator=gen), 2, renormalize=False)
    torch.testing.assert_close(experts_grouped(x, w13, w2, ids, weights),
                               moe_reference(x, w13, w2, ids, weights), atol=1e-5, rtol=1e-5)


def test_packed_experts_equal_the_dense_reference() -> None:
    """The CPU path: every expert's products from its oneDNN-packed weights, fp32 and bf16."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN is not in this torch build")
    gen = torch.Generator().manual_seed(3)
    layer = FusedExperts(num_experts=5, hidden_size=32, intermediate_size=48)
    with torch.no_grad():
        layer.w13.weight.copy_(torch.randn(5 * 96, 32, generator=gen) / 6)
        layer.w2.weight.copy_(torch.randn(5 * 32, 48, generator=gen) / 6)
    x = torch.randn(19, 32, generator=gen)
    weights, ids = route(torch.randn(19, 5, generator=gen), 2, renormalize=True)
    expected = moe_reference(x, layer.w13.stacked(), layer.w2.stacked(), ids, weights)
    layer.pack()
    assert layer.packed is not None and len(layer.packed.w13) == 5
    with torch.inference_mode():
        torch.testing.assert_close(layer(x, ids, weights), expected, atol=1e-5, rtol=1e-5)
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            layer.pack(torch.bfloat16)
            torch.testing.assert_close(layer(x.bfloat16(), ids, weights).float(), expected,
                                       atol=3e-2, rtol=3e-2)
