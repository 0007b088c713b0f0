"""Rotary position embeddings: the inverse frequencies of each scaling kind, and the
cos/sin table the pointwise kernels read."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.engine.models.hf_config import head_dim_of, rope_parameters
from workers.engine.pointwise import TorchPointwise


def rope_inv_freq(hf_config: PretrainedConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) float32, with linear or llama3 scaling when configured."""
    theta, scaling = rope_parameters(hf_config)
    dim = head_dim_of(hf_config)
    # Same arithmetic as Hugging Face so fp32 results match bit for bit.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"model rope_scaling type {rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding from a precomputed (max_positions, 2 D) table.

    Rows hold [cos | cos | -sin | sin] so that rotating is x * cos + roll(x) * sin:
    roll swaps the halves (x1, x2) -> (x2, x1), which with the signed sine gives Hugging
    Face's rotate_half(x) * sin = (-x2 * sin, x1 * sin), bit for bit.
    """

    def __init__(self, inv_freq: torch.Tensor, max_positions: int) -> None:
        super().__init__()
        self.inv_freq = inv_freq
        self.max_positions = max_positions
        self.register_buffer("table", self._table(), persistent=False)

    def _table(self) -> torch.Tensor:
        positions = torch.arange(self.max_positions, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * self.inv_freq[None, :]  # (P, D/2)
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos, -sin, sin], dim=-1)  # (P, 2 D)

    def reset_table(self, device: torch.device, dtype: torch.dtype) -> None:
        """Recompute the table (after building on the meta device)."""
        self.table = self._table().to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor, pointwise: TorchPointwise) -> Any:
        """What `pointwise.rotate` needs for positions (N,); once per forward pass."""
        return pointwise.rope(self.table, positions)
