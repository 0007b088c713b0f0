"""Gated feed-forward blocks: SwiGLU (Llama, Qwen, Phi-3) and GeGLU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.models.linear import FusedLinear, Linear
from workers.engine.pointwise import TorchPointwise

# Hugging Face activation names the gated MLP runs.
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused; act is silu (SwiGLU, through the
    backend's pointwise kernels) or tanh-approximated gelu (GeGLU)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        pointwise: TorchPointwise,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"model activation {activation!r} is not supported; "
                             f"supported: {', '.join(GATED_ACTIVATIONS)}")
        self.pointwise = pointwise
        self.activation = activation
        self.gate_up_proj = FusedLinear(hidden_size, [intermediate_size, intermediate_size], bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, hidden) -> (N, hidden)."""
        gate_up = self.gate_up_proj(x)  # (N, 2 I): gate rows first
        if self.activation == "silu":
            return self.down_proj(self.pointwise.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
