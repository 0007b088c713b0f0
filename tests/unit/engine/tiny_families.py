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


# Short windows so the parity prompts (up to 150 tokens) cross them many times.
WINDOW = 24
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    # The parity prompts (1-150 tokens, decoding up to 20) cross the switch in every way:
    # within a prompt, at the first decode, and later in the decode; Hugging Face's Phi-3
    # re-encodes a sequence with the long factors when it crosses, and so does the engine.
    "original_max_position_embeddings": 64,
    "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
    "long_factor": [1.0, 1.3, 1.7, 2.5, 4.0, 6.0, 9.0, 12.0],
}
GEMMA: dict[str, Any] = {
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": WINDOW,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "initializer_range": 0.3,
}

# family name -> (model_type, config keys beyond COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {"head_dim": 32}),
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW,
                               "max_window_layers": 1}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                               "max_window_layers": 0}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    # Phi3Config takes the original length from its own key, over the rope dict's.
    "phi3-longrope": ("phi3", {"rope_parameters": LONGROPE, "max_position_embeddings": 1024,
                               "original_max_position_embeddings": 64}),
    # Phi-4-mini rotates three quarters of each head.
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.75}),
    "llama-yarn": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 256}}),
    "gemma2": ("gemma2", {**GEMMA, "attn_logit_softcapping": 5.0,
                          "final_logit_softcapping": 30.0}),
    "gemma3": ("gemma3_text", GEMMA),
}  # fmt: skip
