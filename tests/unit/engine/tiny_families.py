"""Tiny random-weight models of each family the engine serves, built from transformers'
own config and model classes (nothing downloaded).

Each builder returns a config small enough for a 2-core CPU. As in tiny_models.py,
`initializer_range` is large so random weights give clearly separated logits; windows
are short (the prompts of the parity tests run past them several times over).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from tests.unit.engine.tiny_models import save_tokenizer

COMMON: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.5,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def family_config(family: str, **overrides: Any) -> PretrainedConfig:
    """The tiny config of one family (see FAMILIES), with overrides applied."""
    model_type, extra = FAMILIES[family]
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, **extra, **overrides})


def save_family(model_dir: Path, family: str, seed: int = 0, **overrides: Any) -> Any:
    """Write a random-weight model of `family` (safetensors) plus tokenizer into model_dir."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **overrides)).eval()
    model.save_pretrained(model_dir)
    save_tokenizer(model_dir)
    return model


# family name -> (model_type, config keys beyond COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {"head_dim": 32}),
}
