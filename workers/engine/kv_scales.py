"""Calibrated scales of an fp8 KV cache, as checkpoints carry them.

An e4m3 byte holds magnitudes up to 448 with 3 mantissa bits. Stored as they are (a scale
of 1), K and V rows beyond that range are clamped: a model whose keys reach a few
thousand loses its attention pattern. Checkpoints made for fp8 KV caches carry a scale per
layer for K and for V (what the rows were divided by when calibrated): the rows are
stored divided by it, and read back times it.

No attention backend needs to know: a score is `scale * q.k`, so keys stored divided by
`k_scale` give the same scores with the softmax scale multiplied by it; the output is a
sum of probabilities times values, so values stored divided by `v_scale` give the output
divided by it, multiplied back once per layer (models/attention.py).

The names the formats use, after a layer's attention module (`...self_attn`):
`k_scale`/`v_scale` (vLLM, compressed-tensors' kv_cache_scheme as vLLM saves it,
llm-compressor), `kv_scale` (one for both: AutoFP8), `k_proj.output_scale`/
`v_proj.output_scale` (compressed-tensors' own), `k_proj.k_scale`/`v_proj.v_scale`
(ModelOpt), `attn.k_scale`/`attn.v_scale`. As vLLM does, they are used only with an fp8
KV cache; with the model's dtype they have nothing to scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# Suffix after the attention module -> which scales it gives.
_SUFFIXES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k",),
    "v_scale": ("v",),
    "kv_scale": ("k", "v"),
    "k_proj.output_scale": ("k",),
    "v_proj.output_scale": ("v",),
    "k_proj.k_scale": ("k",),
    "v_proj.v_scale": ("v",),
    "attn.k_scale": ("k",),
    "attn.v_scale": ("v",),
}
_ATTENTION = "self_attn"


def split_kv_scale_names(names: list[str]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """({attention module: {"k"/"v": tensor name}}, the other names).

    Example: `model.layers.3.self_attn.kv_scale` gives `model.layers.3.self_attn` both
    its scales from that one tensor.
    """
    found: dict[str, dict[str, str]] = {}
    rest: list[str] = []
    for name in names:
        module, sep, suffix = name.partition(f".{_ATTENTION}.")
        kinds = _SUFFIXES.get(suffix) if sep else None
        if kinds is None:
            rest.append(name)
            continue
        for kind in kinds:
            found.setdefault(f"{module}.{_ATTENTION}", {})[kind] = name
    return found, rest


def read_kv_scales(found: dict[str, dict[str, str]], get: Callable[[str], torch.Tensor]
                   ) -> dict[str, tuple[float, float]]:
    """{attention module: (k_scale, v_scale)}, 1.0 for a scale the checkpoint leaves out;
    ValueError naming a scale that is not one positive finite number."""
    scales: dict[str, tuple[float, float]] = {}
    for module, names in found.items():
        values = {kind: _one_scale(name, get(name)) for kind, name in names.items()}
        scales[module] = (values.get("k", 1.0), values.get("v", 1.0))
    return scales


def _one_scale(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise ValueError(f"KV cache scale {name!r} must be one number (a per-tensor scale), "
                         f"got shape {tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"KV cache scale {name!r} must be positive and finite, got {value}")
    return value
