"""The expert layer of mixture-of-experts models: a router and E SwiGLU experts.

Responsible for: choosing each token's top_k experts the way the family does (softmax
over all experts, then top_k, renormalised or not), and running only the chosen experts.
On CUDA the experts run as two Triton grouped GEMMs over the (token, slot) pairs sorted by
expert (`kernels/grouped_gemm.py`); elsewhere as one matmul pair per expert over the
tokens it received (a grouped loop: E small matmuls instead of N * top_k tiny ones).
Both are held to `kernels/moe_reference.py`, which runs every expert on every token.

Weights: `w13` (E, 2 I, H), each expert's gate rows then up rows (the fused gate_up of the
dense MLP, per expert); `w2` (E, H, I); stored 2-D for the loader (`ExpertWeights`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.models.linear import linear_packed, pack_weight
from workers.engine.pointwise import TORCH_POINTWISE, TorchPointwise

# Rows per tile of the grouped GEMM: tl.dot needs 16 at least; 64 amortises each weight
# tile over more tokens once experts receive dozens (prefill), at the cost of padding.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights (N, top_k) float32, topk_ids (N, top_k) int64) from logits (N, E).

    Softmax in fp32 over all experts, then the top_k; Mixtral and Qwen3-MoE renormalise
    the chosen probabilities to sum to 1 (`norm_topk_prob`), Qwen2-MoE keeps them as they
    are. Ties go to the lower expert index, as torch.topk does for Hugging Face.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: PackedExperts | None = None,
    pointwise: TorchPointwise = TORCH_POINTWISE,
) -> torch.Tensor:
    """(N, H): each expert's SwiGLU over the tokens routed to it, weighted and summed.

    With `packed` (the CPU), each expert's two products run from its oneDNN-packed
    weights instead of w13 and w2; `pointwise` is the backend's (its fused SwiGLU).
    """
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs (token, slot) grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    # One gather of every pair's input, and one scatter of the outputs back to pair order
    # at the end: per expert, an index and an index_add_ cost more than the expert's own
    # products at a few tokens each (decode).
    x_sorted = x.index_select(0, order // top_k)
    out_sorted = torch.empty(order.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = x_sorted[start:start + count]
        if packed is None:
            h = F.linear(rows, w13[expert])  # (count, 2 I)
            h = F.linear(pointwise.silu_and_mul(h), w2[expert])  # (count, H)
        else:
            h = linear_packed(rows, packed.w13[expert], None)
            h = linear_packed(pointwise.silu_and_mul(h), packed.w2[expert], None)
        out_sorted[start:start + count] = h
        start += count
    out_sorted *= topk_weights.reshape(-1)[order, None]
    per_pair = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)
    # fp32 sum over the slots, as the Triton path does.
    return per_pair.view(num_tokens, top_k, -1).sum(1).to(x.dtype)


def experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The same as experts_grouped, as two grouped-GEMM launches with no host sync."""
    from workers.engine.kernels.grouped_gemm import align_pairs, grouped_gemm

    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    inter = w2.shape[2]
    block_m = DECODE_BLOCK_M if num_pairs <= 4 * w13.shape[0] else PREFILL_BLOCK_M
    sorted_ids, block_experts = align_pairs(topk_ids, w13.shape[0], block_m)
    h13 = grouped_gemm(x.contiguous(), w13, sorted_ids, block_experts, num_pairs=num_pairs,
                       rows_per_a_row=top_k, block_m=block_m)  # (P, 2 I)
    act = (F.silu(h13[:, :inter]) * h13[:, inter:]).contiguous()  # (P, I)
    per_pair = grouped_gemm(act, w2, sorted_ids, block_experts, num_pairs=num_pairs,
                            rows_per_a_row=1, block_m=block_m,
                            pair_weights=topk_weights.reshape(-1).float().contiguous())
    # fp32 sum over the slots, as the grouped path accumulates.
    return per_pair.view(num_tokens, top_k, -1).float().sum(1).to(x.dtype)


class ExpertWeights(nn.Module):
    """One projection of every expert, stacked: `weight` (E * sum(rows), in) holds expert
    0's matrices (gate then up, for w13), then expert 1's, and so on.

    Kept 2-D with `output_sizes` (one entry per checkpoint matrix, expert after expert) so
    the loader fills it the way it fills any fused projection: checkpoint matrix j of
    expert e is shard e * len(rows) + j.
    """

    def __init__(self, num_experts: int, rows: list[int], in_features: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.output_sizes = rows * num_experts
        self.weight = nn.Parameter(torch.empty(num_experts * sum(rows), in_features))

    def stacked(self) -> torch.Tensor:
        """The weight as (E, sum(rows), in): a view, no copy."""
        return self.weight.view(self.num_experts, -1, self.weight.shape[1])


@dataclass(frozen=True, slots=True)
class PackedExperts:
    """Each expert's w13 and w2 in oneDNN's blocked layout (see linear.pack_weight)."""

    w13: list[torch.Tensor]
    w2: list[torch.Tensor]


class FusedExperts(nn.Module):
    """E SwiGLU experts in two stacked projections, run on the tokens routed to each."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 pointwise: TorchPointwise = TORCH_POINTWISE) -> None:
        super().__init__()
        self.pointwise = pointwise
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.w13 = ExpertWeights(num_experts, [intermediate_size, intermediate_size], hidden_size)
        self.w2 = ExpertWeights(num_experts, [hidden_size], intermediate_size)
        self.packed: PackedExperts | None = None

    def pack(self, dtype: torch.dtype | None = None) -> None:
        """Keep a oneDNN-packed copy of every expert's weights (CPU only), as the dense
        projections do: an expert's products ran 2.2-3.2x faster from it than through
        F.linear at 4-1,024 tokens (576 x 768 experts, fp32, two Zen 4 cores)."""
        self.packed = PackedExperts(
            [pack_weight(w, dtype) for w in self.w13.stacked()],
            [pack_weight(w, dtype) for w in self.w2.stacked()],
        )

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x (N, H) -> (N, H)."""
        w13, w2 = self.w13.stacked(), self.w2.stacked()
        if x.is_cuda:
            return experts_triton(x, w13, w2, topk_ids, topk_weights)
        return experts_grouped(x, w13, w2, topk_ids, topk_weights, self.packed, self.pointwise)
