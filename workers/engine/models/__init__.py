"""Decoder families over shared layers, and the registry from `model_type` to family.

Shared layers: linear.py (packed and fused projections), norm.py, rotary.py,
attention.py (the attention layer over a paged-KV backend), mlp.py. One module per family
(llama.py: Llama, Mistral, Qwen2) composes them; base.py holds what every causal LM shares.
"""

from workers.engine.models.base import CausalLM
from workers.engine.models.hf_config import head_dim_of, kv_window, num_kv_heads_of
from workers.engine.models.registry import (
    MODEL_CLASSES,
    SUPPORTED_MODEL_TYPES,
    check_supported,
    model_class_for,
)

__all__ = [
    "MODEL_CLASSES",
    "SUPPORTED_MODEL_TYPES",
    "CausalLM",
    "check_supported",
    "head_dim_of",
    "kv_window",
    "model_class_for",
    "num_kv_heads_of",
]
