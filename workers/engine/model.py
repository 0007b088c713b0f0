"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) on torch, over a paged KV cache.

Tokens of every sequence in a step are packed along one axis (no padding): the model sees
`input_ids (N,)` and `positions (N,)`, and attention finds each token's sequence through
the backend metadata. Projections are fused (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`) so a layer runs two large matmuls instead of five; the loader concatenates
Hugging Face's separate weights into them. Pointwise steps (SwiGLU, rotary, residual add
and RMSNorm) come from the backend's `pointwise` (workers/engine/pointwise.py): eager torch,
or fused kernels on the CPU.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from workers.engine.attention import AttentionBackend
from workers.engine.pointwise import TorchPointwise

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}


def check_supported(hf_config: PretrainedConfig) -> None:
    """Raise ValueError naming `model` for architectures this decoder cannot run."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model architecture {model_type!r} is not supported; "
            f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"model hidden_act {hf_config.hidden_act!r} is not supported (silu only)")
    if model_type == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("model uses sliding-window attention, which is not supported")
    if model_type == "mistral" and getattr(hf_config, "sliding_window", None):
        raise ValueError("model uses sliding-window attention, which is not supported")
    rope_inv_freq(hf_config)  # raises for unsupported rope scaling


def _rope_parameters(hf_config: PretrainedConfig) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from either transformers' new `rope_parameters` or the old keys."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    scaling = dict(params) if params.get("rope_type", "default") != "default" else {}
    legacy = getattr(hf_config, "rope_scaling", None)
    if not scaling and legacy:
        scaling = dict(legacy)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    return theta, scaling


def rope_inv_freq(hf_config: PretrainedConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) float32, with linear or llama3 scaling when configured."""
    theta, scaling = _rope_parameters(hf_config)
    dim = head_dim_of(hf_config)
    # Same arithmetic as Hugging Face so fp32 results match bit for bit.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"model rope_scaling type {rope_type!r} is not supported")


def head_dim_of(hf_config: PretrainedConfig) -> int:
    """Per-head size: explicit `head_dim`, else hidden_size / num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


def pack_weight(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A (out, in) CPU weight re-laid in oneDNN's blocked format for `linear_packed`,
    optionally converted to `dtype` first.

    The layout is chosen once instead of on every call: at 16-64 rows a SmolLM2-135M
    projection runs 1.2-2.2x faster than F.linear in fp32 (which re-packs the weight per
    call), 1.1-1.5x in bf16. bf16 results are bit-identical to F.linear; fp32 differ in the
    last bits (another summation order), as any other GEMM kernel would.

    A half-precision weight packed as fp32 serves a CPU without oneDNN's bf16/fp16
    instructions: there F.linear in bf16 runs 4-7x slower than fp32 at 16-512 rows
    (AVX2-only EPYC), while the upcast is exact, so only the summation order differs.
    """
    weight = weight.detach()
    if dtype is not None:
        weight = weight.to(dtype)
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear with a weight from pack_weight(); x (N, in) -> (N, out), in x's dtype.

    With a weight packed in a wider dtype than x, x and the bias are widened for the
    product and the result rounded back, as a half-precision GEMM accumulating in fp32 does.
    """
    linear = torch.ops.mkldnn._linear_pointwise
    if packed.dtype == x.dtype:
        return cast(torch.Tensor, linear(x, packed, bias, "none", [], ""))
    wide_bias = None if bias is None else bias.to(packed.dtype)
    out = linear(x.to(packed.dtype), packed, wide_bias, "none", [], "")
    return cast(torch.Tensor, out).to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear that runs from a pre-packed weight once `pack()` made one (CPU only)."""

    packed_weight: torch.Tensor | None = None

    def pack(self, dtype: torch.dtype | None = None) -> None:
        """Keep a oneDNN-blocked copy of the weight (in `dtype`, if given); `weight` stays
        as loaded."""
        self.packed_weight = pack_weight(self.weight, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, in) -> (N, out)."""
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        return linear_packed(x, self.packed_weight, self.bias)


class FusedLinear(Linear):
    """A Linear whose output rows stack several checkpoint matrices (q/k/v, gate/up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, normalising in fp32 as Hugging Face does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of x (N, hidden)."""
        if x.dtype == torch.float32:  # one fused kernel, bit-identical to the formula below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding from a precomputed (max_positions, 2 D) table.

    Rows hold [cos | cos | -sin | sin] so that rotating is x * cos + roll(x) * sin:
    roll swaps the halves (x1, x2) -> (x2, x1), which with the signed sine gives Hugging
    Face's rotate_half(x) * sin = (-x2 * sin, x1 * sin), bit for bit.
    """

    def __init__(self, inv_freq: torch.Tensor, max_positions: int) -> None:
        super().__init__()
        self.inv_freq = inv_freq
        self.max_positions = max_positions
        self.register_buffer("table", self._table(), persistent=False)

    def _table(self) -> torch.Tensor:
        positions = torch.arange(self.max_positions, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * self.inv_freq[None, :]  # (P, D/2)
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos, -sin, sin], dim=-1)  # (P, 2 D)

    def reset_table(self, device: torch.device, dtype: torch.dtype) -> None:
        """Recompute the table (after building on the meta device)."""
        self.table = self._table().to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor, pointwise: TorchPointwise) -> Any:
        """What `pointwise.rotate` needs for positions (N,); once per forward pass."""
        return pointwise.rope(self.table, positions)


class Attention(nn.Module):
    """Fused q/k/v projection, RoPE, paged attention and output projection."""

    def __init__(self, hf_config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(hf_config)
        hidden = hf_config.hidden_size
        # Qwen2 biases q/k/v only; Llama's attention_bias covers all four projections.
        is_qwen2 = hf_config.model_type == "qwen2"
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias, o_bias = is_qwen2 or attention_bias, not is_qwen2 and attention_bias
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(hidden, [self.q_size, self.kv_size, self.kv_size], qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias)
        self.backend = backend

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
        # Rotate q and k together: one kernel chain for H + Hkv heads. (N, H + Hkv, D)
        qk = self.backend.pointwise.rotate(
            qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim), rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, k_cache, v_cache, metadata)  # (N, H * D)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, hf_config: PretrainedConfig, pointwise: TorchPointwise) -> None:
        super().__init__()
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        self.pointwise = pointwise
        bias = bool(getattr(hf_config, "mlp_bias", False))
        self.gate_up_proj = FusedLinear(hidden, [inter, inter], bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, hidden) -> (N, hidden)."""
        return self.down_proj(self.pointwise.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual.

    The residual stream is carried beside each block's output (`delta`) and added inside
    the next norm, so a fused kernel can do add and norm in one pass.
    """

    def __init__(self, hf_config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps)
        self.self_attn = Attention(hf_config, backend)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps)
        self.mlp = MLP(hf_config, backend.pointwise)
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


class DecoderModel(nn.Module):
    """Embedding, the decoder stack and the final norm (Hugging Face's `model.*` weights)."""

    def __init__(self, hf_config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, backend) for _ in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole decoder; forward() returns hidden states, compute_logits() the vocab scores."""

    def __init__(self, hf_config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__()
        check_supported(hf_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = DecoderModel(hf_config, backend)
        self.rotary = RotaryEmbedding(rope_inv_freq(hf_config), hf_config.max_position_embeddings)
        self.lm_head: nn.Linear | None = None
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        self.packed_logits_weight: torch.Tensor | None = None  # set by pack_weights()
        self.pointwise = backend.pointwise

    @property
    def layers(self) -> list[DecoderLayer]:
        """The decoder layers, in order."""
        return [cast(DecoderLayer, layer) for layer in self.model.layers]

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

    def pack_weights(self, dtype: torch.dtype | None = None) -> None:
        """Pre-pack every projection's weight for oneDNN, in `dtype` if given (the CPU
        placement calls this).

        Costs a second copy of the projection weights in memory (the loaded ones stay, for
        whoever reads them; an fp32 copy of bf16 weights is twice their size); start-up
        grows by well under a second for SmolLM2-135M.
        """
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(dtype)
        self.packed_logits_weight = pack_weight(self._logits_weight, dtype)

    @property
    def _logits_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (M, hidden) -> float32 logits (M, vocab), only for the rows that sample."""
        if self.packed_logits_weight is not None:
            return linear_packed(hidden, self.packed_logits_weight, None).float()
        return F.linear(hidden, self._logits_weight).float()
