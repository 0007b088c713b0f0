"""Rotary position embeddings: the inverse frequencies of each scaling kind, and the
cos/sin table the pointwise kernels read.

Scaled kinds (linear, llama3, yarn, dynamic, longrope) take their frequencies and
attention factor from transformers' own `ROPE_INIT_FUNCTIONS`, so they match Hugging Face
bit for bit. Two kinds recompute frequencies as a sequence grows in Hugging Face:
- dynamic (NTK) changes them only past `max_position_embeddings`, which max_model_len
  never exceeds: every served position uses the unscaled frequencies, as Hugging Face does.
- longrope uses its short factors while a sequence holds at most
  `original_max_position_embeddings` tokens and its long factors for every position once
  it is longer (Hugging Face's Phi-3 drops its cache to re-encode the whole sequence when
  it crosses). The table holds both sets, short rows first and long rows `long_offset`
  further on; the model runner adds that offset to the positions of a sequence in long
  mode (`Sequence.rope_long`), and the scheduler recomputes a sequence that crosses.

`partial_rotary_factor` < 1 (Phi-4-mini) rotates the first `head_dim * factor` dimensions
of each head and passes the rest through, as Hugging Face's Phi-3 does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from workers.engine.models.hf_config import head_dim_of
from workers.engine.pointwise import TorchPointwise

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Frequencies of one rotary table (rotating 2 * len(inv_freq) dimensions of a head):
    longrope's long factors besides, for sequences longer than `switch_position`; cos and
    sin scaled by `attention_scaling`."""

    inv_freq: torch.Tensor  # (D/2,) float32
    attention_scaling: float = 1.0
    long_inv_freq: torch.Tensor | None = None
    switch_position: int | None = None


def rope_parameters_of(hf_config: PretrainedConfig, layer_type: str | None) -> dict[str, Any]:
    """The rope parameter dict of the config, or of one layer type where it has one per
    type (Gemma 3: a local and a global base)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # a config class without rope_parameters: the old keys
        legacy = dict(getattr(hf_config, "rope_scaling", None) or {})
        legacy.setdefault("rope_type", legacy.get("type", "default"))
        legacy.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return legacy
    if layer_type is not None and layer_type in params:
        return dict(params[layer_type])
    return dict(params)


def rope_spec(hf_config: PretrainedConfig, layer_type: str | None = None) -> RopeSpec:
    """The rotary frequencies of the config (of one layer type, when it names them per
    type); ValueError for kinds this engine does not run."""
    params = rope_parameters_of(hf_config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"model rope_scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(params.get("partial_rotary_factor", 1.0))
    head_dim = head_dim_of(hf_config)
    dim = int(head_dim * partial)  # Hugging Face's rounding
    if not 0 < partial <= 1 or dim < 2 or dim % 2:
        raise ValueError(f"model partial_rotary_factor {partial} does not rotate an even number "
                         f"of a head's {head_dim} dimensions")
    if rope_type in ("default", "dynamic"):  # dynamic: unscaled up to max_position_embeddings
        theta = float(params.get("rope_theta", 10000.0))
        # Same arithmetic as Hugging Face so fp32 results match bit for bit.
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        return RopeSpec(1.0 / (theta**exponents))
    kwargs: dict[str, Any] = {} if layer_type is None else {"layer_type": layer_type}
    # On the CPU even while the model is built on the meta device: the table needs values.
    with torch.device("cpu"):
        spec = _scaled_spec(hf_config, params, rope_type, **kwargs)
    if 2 * spec.inv_freq.numel() != dim:
        raise ValueError(f"model rope_scaling {rope_type!r} rotates {2 * spec.inv_freq.numel()} "
                         f"dimensions of a head where partial_rotary_factor asks {dim}")
    return spec


def _scaled_spec(
    hf_config: PretrainedConfig, params: dict[str, Any], rope_type: str, **kwargs: Any
) -> RopeSpec:
    """rope_spec() of a scaled kind, through transformers' own initialisation."""
    init = ROPE_INIT_FUNCTIONS[rope_type]
    try:
        inv_freq, scaling = init(hf_config, torch.device("cpu"), **kwargs)
        if rope_type != "longrope":
            return RopeSpec(inv_freq.float(), float(scaling))
        switch = int(params["original_max_position_embeddings"])
        long_inv_freq, _ = init(hf_config, torch.device("cpu"), seq_len=switch + 1, **kwargs)
    except (KeyError, TypeError) as e:
        raise ValueError(f"model rope_scaling {rope_type!r} lacks a parameter: {e}") from e
    return RopeSpec(inv_freq.float(), float(scaling), long_inv_freq.float(), switch)


def rope_inv_freq(hf_config: PretrainedConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) float32 of the config's rotary embedding."""
    return rope_spec(hf_config).inv_freq


class RotaryEmbedding(nn.Module):
    """Rotary position embedding from a precomputed (rows, 2 R) table, R the rotated
    dimensions of a head.

    Rows hold [cos | cos | -sin | sin] so that rotating is x * cos + roll(x) * sin:
    roll swaps the halves (x1, x2) -> (x2, x1), which with the signed sine gives Hugging
    Face's rotate_half(x) * sin = (-x2 * sin, x1 * sin), bit for bit. With longrope the
    table has `max_positions` rows of the short factors, then as many of the long ones.
    """

    def __init__(self, spec: RopeSpec | torch.Tensor, max_positions: int) -> None:
        super().__init__()
        self.spec = spec if isinstance(spec, RopeSpec) else RopeSpec(spec)
        self.inv_freq = self.spec.inv_freq
        self.max_positions = max_positions
        self.register_buffer("table", self._table(), persistent=False)

    @property
    def long_offset(self) -> int | None:
        """What a sequence in longrope's long mode adds to its positions (None: no modes)."""
        return self.max_positions if self.spec.long_inv_freq is not None else None

    def _table(self) -> torch.Tensor:
        spec = self.spec
        positions = torch.arange(self.max_positions, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * spec.inv_freq[None, :]  # (P, R/2)
        if spec.long_inv_freq is not None:
            freqs = torch.cat([freqs, positions[:, None] * spec.long_inv_freq[None, :]])
        cos, sin = freqs.cos(), freqs.sin()
        if spec.attention_scaling != 1.0:
            cos, sin = cos * spec.attention_scaling, sin * spec.attention_scaling
        return torch.cat([cos, cos, -sin, sin], dim=-1)  # (P or 2 P, 2 R)

    def reset_table(self, device: torch.device, dtype: torch.dtype) -> None:
        """Recompute the table (after building on the meta device)."""
        self.table = self._table().to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor, pointwise: TorchPointwise) -> Any:
        """What `pointwise.rotate` needs for positions (N,); once per forward pass."""
        return pointwise.rope(self.table, positions)
