"""Root-mean-square layer norms."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, normalising in fp32 as Hugging Face does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of x (N, hidden)."""
        if x.dtype == torch.float32:  # one fused kernel, bit-identical to the formula below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: weights stored as offsets from 1, scaled as x_hat * (1 + w) in fp32
    and rounded back once (Llama rounds x_hat before its multiply)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of x (..., hidden)."""
        h = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
