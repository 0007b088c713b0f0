"""Random-weight models of each served family at SmolLM2-135M's shape, for
`bench.engine_throughput --family`: the same widths, depth and vocabulary in every
family, so throughput differences come from what each family adds (q/k norms, sliding
windows, soft-capping, sandwich norms, GeGLU), not from its size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# SmolLM2-135M: 30 layers of 576 wide, 9 query and 3 KV heads of 64, MLP 1536.
SHAPE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
GEMMA = {"query_pre_attn_scalar": 64, "sliding_window": 512,
         "hidden_activation": "gelu_pytorch_tanh"}
# Mixtures: 8 experts of half the MLP width, 2 per token, so a token's MLP FLOPs equal
# the dense families' (per-FLOP comparisons count the active parameters only).
MOE = {"num_experts_per_tok": 2, "router_jitter_noise": 0.0}

# family -> (model_type, config keys beyond SHAPE)
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral-window": ("mistral", {"sliding_window": 512}),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", {**GEMMA, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0}),
    "gemma3": ("gemma3_text", GEMMA),
    "mixtral": ("mixtral", {**MOE, "num_local_experts": 8, "intermediate_size": 768}),
    "qwen3-moe": ("qwen3_moe", {**MOE, "num_experts": 8, "moe_intermediate_size": 768,
                                "decoder_sparse_step": 1, "norm_topk_prob": True}),
}  # fmt: skip


def random_family_model(family: str, root: Path) -> Path:
    """Save a random-weight model of `family` (fp32 safetensors) under root; its path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILY_CONFIGS[family]
    config = AutoConfig.for_model(model_type, **{**SHAPE, **extra})
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(config)
    path = root / f"random-{family}-135m"
    model.save_pretrained(path)
    return path
