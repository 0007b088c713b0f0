"""Gemma 2 and Gemma 3 (text) over a paged KV cache.

What differs from the Llama layout: embeddings scaled by sqrt(hidden_size); RMSNorms
that scale by (1 + weight); a norm after attention and after the MLP as well as before
each; GeGLU (tanh-approximated gelu); a softmax scale of query_pre_attn_scalar ** -0.5;
local sliding-window layers interleaved with global ones (`layer_types`). Gemma 2 adds
soft-capping of attention logits (inside every attention backend) and of the final
logits; Gemma 3 adds q/k norms and a second rope base for its local layers.

Residual adds run as torch ops (TorchPointwise) on every backend: the fused CPU
add + RMSNorm kernel scales by weight, not (1 + weight).
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
from workers.engine.models.norm import GemmaRMSNorm
from workers.engine.models.rotary import RotaryEmbedding, rope_spec
from workers.engine.pointwise import TORCH_POINTWISE


def _layer_type(hf_config: PretrainedConfig, index: int) -> str:
    """'sliding_attention' or 'full_attention' for layer `index`."""
    return str(hf_config.layer_types[index])


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm layer: norm, attention, norm, residual; norm, MLP, norm, residual."""

    def __init__(
        self, hf_config: PretrainedConfig, backend: AttentionBackend, layer_index: int
    ) -> None:
        super().__init__()
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        self.layer_type = _layer_type(hf_config, layer_index)
        is_gemma3 = hf_config.model_type == "gemma3_text"
        softcap = getattr(hf_config, "attn_logit_softcapping", None)
        params = AttentionParams(
            scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
            sliding_window=layer_windows(hf_config)[layer_index],
            softcap=float(softcap) if softcap else None,
        )
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.self_attn = Attention(
            hf_config, backend, qkv_bias=bias, o_bias=bias, params=params,
            qk_norm=GemmaRMSNorm(head_dim_of(hf_config), eps) if is_gemma3 else None,
        )  # fmt: skip
        self.mlp = GatedMLP(hidden, hf_config.intermediate_size, False, backend.pointwise,
                            activation=hf_config.hidden_activation)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        rope: Any,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous layer's output or None, residual stream) -> the same for the next."""
        h, residual = TORCH_POINTWISE.add_rms_norm(self.input_layernorm, delta, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, k_cache, v_cache, metadata))
        h, residual = TORCH_POINTWISE.add_rms_norm(self.pre_feedforward_layernorm, h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaModel(nn.Module):
    """Embedding, the decoder stack and the final norm (Hugging Face's `model.*` weights)."""

    def __init__(self, hf_config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(hf_config, backend, i) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class GemmaForCausalLM(CausalLM):
    """Gemma 2 and Gemma 3 text decoders."""

    def __init__(self, hf_config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__(hf_config, backend)
        self.model = GemmaModel(hf_config, backend)
        self.embed_scale = float(hf_config.hidden_size) ** 0.5
        # One rotary table per layer type: Gemma 3's local layers use their own base.
        max_positions = hf_config.max_position_embeddings
        self.rotary = nn.ModuleDict({
            t: RotaryEmbedding(rope_spec(hf_config, t), max_positions)
            for t in sorted(set(hf_config.layer_types))
        })  # fmt: skip
        cap = getattr(hf_config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None

    @classmethod
    def check_config(cls, hf_config: PretrainedConfig) -> None:
        """Causal text decoders with the gated activations and rope kinds we run."""
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("model uses bidirectional attention, which is not supported")
        activation = getattr(hf_config, "hidden_activation", None)
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"model hidden_activation {activation!r} is not supported "
                             "(gelu_pytorch_tanh only)")
        layer_windows(hf_config)
        for layer_type in set(hf_config.layer_types):
            rope_spec(hf_config, layer_type)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """input_ids, positions (N,) -> hidden states (N, hidden); kv_cache as in Llama."""
        embeds = self.model.embed_tokens(input_ids)
        # The scale rounded to the activations' dtype first, as Hugging Face does.
        residual = embeds * float(torch.tensor(self.embed_scale, dtype=embeds.dtype))
        ropes = {t: rotary(positions, self.pointwise) for t, rotary in self.rotary.items()}
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            rope = ropes[layer.layer_type]
            delta, residual = layer(delta, residual, rope, kv_cache[0, i], kv_cache[1, i], metadata)
        return TORCH_POINTWISE.add_rms_norm(self.model.norm, delta, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocab scores, soft-capped where the config says so (Gemma 2)."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
