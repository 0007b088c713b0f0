"""Llama-layout decoders (Llama, SmolLM2, Mistral, Qwen2; Qwen3 and Phi-3 build on it)
over a paged KV cache.

Tokens of every sequence in a step are packed along one axis (no padding): the model sees
`input_ids (N,)` and `positions (N,)`, and attention finds each token's sequence through
the backend metadata. Projections are fused (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`) so a layer runs two large matmuls instead of five; the loader fills them
from Hugging Face's separate weights through `packed_modules_mapping`. Pointwise steps
(SwiGLU, rotary, residual add and RMSNorm) come from the backend's `pointwise`
(workers/engine/pointwise.py): eager torch, or fused kernels on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.engine.attention import AttentionBackend, AttentionParams
from workers.engine.models.attention import Attention
from workers.engine.models.base import CausalLM
from workers.engine.models.hf_config import head_dim_of, layer_windows
from workers.engine.models.mlp import GatedMLP
from workers.engine.models.norm import RMSNorm
from workers.engine.models.rotary import RotaryEmbedding, rope_spec


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual.

    The residual stream is carried beside each block's output (`delta`) and added inside
    the next norm, so a fused kernel can do add and norm in one pass.
    """

    # Qwen3: RMSNorm over each query and key head before RoPE.
    qk_norm = False

    def __init__(
        self, hf_config: PretrainedConfig, backend: AttentionBackend, layer_index: int
    ) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        hidden = hf_config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps)
        # Qwen2 biases q/k/v only (Qwen2-MoE as its `qkv_bias` says); Llama's
        # attention_bias covers all four projections.
        is_qwen2 = hf_config.model_type in ("qwen2", "qwen2_moe")
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qwen2_qkv_bias = is_qwen2 and bool(getattr(hf_config, "qkv_bias", True))
        window = layer_windows(hf_config)[layer_index]
        self.self_attn = Attention(
            hf_config, backend,
            qkv_bias=qwen2_qkv_bias or attention_bias, o_bias=not is_qwen2 and attention_bias,
            params=AttentionParams(sliding_window=window),
            qk_norm=RMSNorm(head_dim_of(hf_config), eps) if self.qk_norm else None,
        )  # fmt: skip
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(
            hidden, hf_config.intermediate_size, bool(getattr(hf_config, "mlp_bias", False)),
            backend.pointwise,
        )  # fmt: skip
        self.pointwise = backend.pointwise

    def forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        rope: Any,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous block's output or None, residual stream) -> the same for the next,
        each (N, hidden): the input is residual + delta."""
        h, residual = self.pointwise.add_rms_norm(self.input_layernorm, delta, residual)
        h = self.self_attn(h, rope, k_cache, v_cache, metadata)
        h, residual = self.pointwise.add_rms_norm(self.post_attention_layernorm, h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Embedding, the decoder stack and the final norm (Hugging Face's `model.*` weights)."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        backend: AttentionBackend,
        layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            layer_class(hf_config, backend, i) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral and Qwen2: one rotary table, pre-norm layers, SwiGLU, sliding
    windows where the config has them."""

    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, hf_config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__(hf_config, backend)
        self.model = LlamaModel(hf_config, backend, self.layer_class)
        self.rotary = RotaryEmbedding(rope_spec(hf_config), hf_config.max_position_embeddings)

    @classmethod
    def check_config(cls, hf_config: PretrainedConfig) -> None:
        """SwiGLU only; rope kinds and layer types this engine runs."""
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(
                f"model hidden_act {hf_config.hidden_act!r} is not supported (silu only)")
        layer_windows(hf_config)
        rope_spec(hf_config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """input_ids, positions (N,) -> hidden states (N, hidden).

        kv_cache is the whole pool, (2, num_layers, num_blocks, block_size, Hkv, D).
        """
        delta, residual = None, self.model.embed_tokens(input_ids)
        rope = self.rotary(positions, self.pointwise)
        for i, layer in enumerate(self.model.layers):
            delta, residual = layer(delta, residual, rope, kv_cache[0, i], kv_cache[1, i], metadata)
        return self.pointwise.add_rms_norm(self.model.norm, delta, residual)[0]
