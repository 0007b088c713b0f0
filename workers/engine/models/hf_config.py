"""Reading the fields of a Hugging Face config that families spell differently."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


def head_dim_of(hf_config: PretrainedConfig) -> int:
    """Per-head size: explicit `head_dim`, else hidden_size / num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


def num_kv_heads_of(hf_config: PretrainedConfig) -> int:
    """Key/value heads: `num_key_value_heads`, else one per query head (no GQA)."""
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def rope_parameters(hf_config: PretrainedConfig) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from either transformers' new `rope_parameters` or the old keys."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    scaling = dict(params) if params.get("rope_type", "default") != "default" else {}
    legacy = getattr(hf_config, "rope_scaling", None)
    if not scaling and legacy:
        scaling = dict(legacy)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    return theta, scaling
