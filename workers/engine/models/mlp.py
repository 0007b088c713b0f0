"""Gated feed-forward blocks."""

from __future__ import annotations

import torch
from torch import nn

from workers.engine.models.linear import FusedLinear, Linear
from workers.engine.pointwise import TorchPointwise


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) with gate and up fused."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, pointwise: TorchPointwise
    ) -> None:
        super().__init__()
        self.pointwise = pointwise
        self.gate_up_proj = FusedLinear(hidden_size, [intermediate_size, intermediate_size], bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, hidden) -> (N, hidden)."""
        return self.down_proj(self.pointwise.silu_and_mul(self.gate_up_proj(x)))
