"""Qwen2-MoE and Qwen3-MoE: the Qwen2 and Qwen3 layouts with sparse feed-forward blocks.

A layer is sparse unless listed in `mlp_only_layers` or off the `decoder_sparse_step`
grid; its block adds a shared expert behind a sigmoid gate to the routed experts, whose
top_k probabilities are renormalised only with `norm_topk_prob`.
"""

from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig

from workers.engine.attention import AttentionBackend
from workers.engine.models.llama import LlamaForCausalLM
from workers.engine.models.moe import SparseMoeBlock
from workers.engine.models.qwen3 import Qwen3DecoderLayer

# checkpoint projection name of an expert -> (our stacked projection, matrix index)
QWEN_EXPERTS: dict[str, tuple[str, int]] = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1),
                                            "down_proj": ("w2", 0)}


def is_sparse_layer(hf_config: PretrainedConfig, index: int) -> bool:
    """Whether layer `index` has experts, as Hugging Face's Qwen MoE decoders decide."""
    only_dense = getattr(hf_config, "mlp_only_layers", None) or []
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (index not in only_dense and hf_config.num_experts > 0
            and (index + 1) % step == 0)


def sparse_block(hf_config: PretrainedConfig, backend: AttentionBackend) -> SparseMoeBlock:
    """The experts of one Qwen MoE layer, with the shared expert when the config has one."""
    return SparseMoeBlock(
        hidden_size=hf_config.hidden_size,
        num_experts=hf_config.num_experts,
        top_k=hf_config.num_experts_per_tok,
        expert_intermediate_size=hf_config.moe_intermediate_size,
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        pointwise=backend.pointwise,
        shared_intermediate_size=getattr(hf_config, "shared_expert_intermediate_size", None),
    )


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2 attention (biased q/k/v); experts in the layers the config makes sparse."""

    expert_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = QWEN_EXPERTS

    def __init__(self, hf_config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__(hf_config, backend)
        for index, layer in enumerate(self.model.layers):
            if is_sparse_layer(hf_config, index):
                layer.mlp = sparse_block(hf_config, backend)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3 attention (q/k norms, no biases); the same sparse blocks, no shared expert."""

    layer_class = Qwen3DecoderLayer
