"""Qwen3: the Llama layout with an RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

from workers.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose attention normalises q and k per head (q_norm, k_norm)."""

    qk_norm = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models."""

    layer_class = Qwen3DecoderLayer
