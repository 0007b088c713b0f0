"""The attention layer of a decoder: fused q/k/v projection, optional per-head q/k norms,
rotary, attention over the paged KV cache (through the step's attention backend, with the
layer's own scale, sliding window and soft-capping) and the output projection."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.engine.attention import FULL_ATTENTION, AttentionBackend, AttentionParams
from workers.engine.kv_dtypes import FP8_KV
from workers.engine.models.hf_config import head_dim_of, num_kv_heads_of
from workers.engine.models.linear import FusedLinear, Linear


class Attention(nn.Module):
    """Fused q/k/v projection, (q/k norm,) RoPE, paged attention and output projection."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        backend: AttentionBackend,
        *,
        qkv_bias: bool,
        o_bias: bool,
        params: AttentionParams = FULL_ATTENTION,
        qk_norm: nn.Module | None = None,
    ) -> None:
        """qk_norm: a norm over head_dim, applied to each query and key head before RoPE
        (Qwen3, Gemma 3); it is copied for k, so q and k keep their own weights."""
        super().__init__()
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = num_kv_heads_of(hf_config)
        self.head_dim = head_dim_of(hf_config)
        hidden = hf_config.hidden_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(hidden, [self.q_size, self.kv_size, self.kv_size], qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm, copy.deepcopy(qk_norm)
        self.backend = backend
        self.params = params
        # The checkpoint's calibrated scales of an fp8 KV pool (see kv_scales), and the
        # params with the softmax scale that reads keys stored divided by k_scale.
        self.kv_scales: tuple[float, float] | None = None
        self._fp8_params = params

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Store K and V divided by these in an fp8 pool (1.0, 1.0: as they are)."""
        self.kv_scales = None if (k_scale, v_scale) == (1.0, 1.0) else (k_scale, v_scale)
        scale = self.params.scale if self.params.scale is not None else self.head_dim ** -0.5
        self._fp8_params = dataclasses.replace(self.params, scale=scale * k_scale)

    def forward(
        self,
        x: torch.Tensor,
        rope: Any,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """x (N, hidden) -> (N, hidden); rope is what RotaryEmbedding made of the positions."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)  # (N, (H + 2 Hkv) * D)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # Rotate q and k together: one kernel chain for H + Hkv heads. (N, H + Hkv, D)
        qk = self.backend.pointwise.rotate(qk, rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.kv_scales is not None and k_cache.dtype == FP8_KV:
            k_scale, v_scale = self.kv_scales
            out = self.backend.forward(q, k / k_scale, v / v_scale, k_cache, v_cache, metadata,
                                       self._fp8_params)
            return self.o_proj(out * v_scale)
        out = self.backend.forward(q, k, v, k_cache, v_cache, metadata, self.params)
        return self.o_proj(out)  # (N, H * D) -> (N, hidden)
