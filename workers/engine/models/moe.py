"""The sparse feed-forward block of mixture-of-experts decoders: a router over E experts,
the chosen experts, and (Qwen2-MoE) a shared expert behind a sigmoid gate.

Responsible for: the block's weights as Hugging Face names them (`gate`, `experts.<i>.*`,
`shared_expert.*`, `shared_expert_gate`), and for routing as the family does.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.engine.models.experts import FusedExperts, route
from workers.engine.models.linear import Linear
from workers.engine.models.mlp import GatedMLP
from workers.engine.pointwise import TorchPointwise


class SparseMoeBlock(nn.Module):
    """x (N, H) -> sum of the top_k experts' outputs, plus the gated shared expert if any."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        expert_intermediate_size: int,
        renormalize: bool,
        pointwise: TorchPointwise,
        shared_intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"model routes each token to {top_k} of {num_experts} experts; "
                             "top_k must be between 1 and the number of experts")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, expert_intermediate_size,
                                    pointwise)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, False, pointwise)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, H) -> (N, H)."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
