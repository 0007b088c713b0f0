"""What every causal LM here shares: the vocab projection (tied or not, packed for the
CPU), weight packing, and the table the loader reads to fill fused projections."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from workers.engine.attention import AttentionBackend
from workers.engine.models.experts import FusedExperts
from workers.engine.models.linear import Linear, linear_packed, pack_weight
from workers.engine.models.rotary import RotaryEmbedding

# Hugging Face keeps these projections apart; our decoders run each group as one matmul.
# checkpoint module name -> (our fused module, shard index within its output rows)
SEPARATE_QKV_GATE_UP: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class CausalLM(nn.Module):
    """Base of the family classes: forward() returns hidden states, compute_logits() the
    vocab scores. Subclasses build `self.model` (with `embed_tokens`) and the rest."""

    # Read by the loader: checkpoint module name -> (fused module here, shard index).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = SEPARATE_QKV_GATE_UP
    # Read by the loader for `...experts.<i>.<name>.weight`: an expert's checkpoint
    # projection -> (our stacked projection, matrix index within the expert's rows).
    expert_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}
    # The family's own stack (Hugging Face's `model.*` weights): embed_tokens, layers, norm.
    model: Any
    lm_head: nn.Linear | None

    def __init__(self, hf_config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.pointwise = backend.pointwise
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        self.packed_logits_weight: torch.Tensor | None = None  # set by pack_weights()

    @classmethod
    def check_config(cls, hf_config: PretrainedConfig) -> None:
        """Raise ValueError for a config of this family that the class cannot run."""

    def reset_buffers(self, device: torch.device, dtype: torch.dtype) -> None:
        """Recompute the non-persistent buffers (rotary tables) after a meta-device build."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_table(device, dtype)

    def pack_weights(self, dtype: torch.dtype | None = None) -> None:
        """Pre-pack every projection's weight for oneDNN, in `dtype` if given (the CPU
        placement calls this).

        Costs a second copy of the projection weights in memory (the loaded ones stay, for
        whoever reads them; an fp32 copy of bf16 weights is twice their size); start-up
        grows by well under a second for SmolLM2-135M.
        """
        for module in self.modules():
            if isinstance(module, Linear | FusedExperts):
                module.pack(dtype)
        self.packed_logits_weight = pack_weight(self._logits_weight, dtype)

    @property
    def longrope(self) -> tuple[int, int] | None:
        """(original_max_position_embeddings, the offset of the long rows) when the rotary
        tables hold longrope's two sets of factors (see rotary.py); None otherwise."""
        tables = [m for m in self.modules() if isinstance(m, RotaryEmbedding)]
        modes = {(m.spec.switch_position, m.long_offset) for m in tables}
        if all(offset is None for _, offset in modes):
            return None
        if len(modes) != 1:
            raise ValueError("model mixes longrope with other rope kinds across its layers; "
                             "not supported")
        switch, offset = modes.pop()
        assert switch is not None and offset is not None
        return switch, offset

    @property
    def layers(self) -> list[Any]:
        """The decoder layers, in order."""
        return list(self.model.layers)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The input embedding (also the vocab projection when tied)."""
        embed = self.model.embed_tokens
        assert isinstance(embed, nn.Embedding)
        return embed

    @property
    def _logits_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (M, hidden) -> float32 logits (M, vocab), only for the rows that sample."""
        if self.packed_logits_weight is not None:
            return linear_packed(hidden, self.packed_logits_weight, None).float()
        return F.linear(hidden, self._logits_weight).float()
