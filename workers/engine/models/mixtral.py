"""Mixtral: the Llama layout with every feed-forward a sparse mixture of experts.

Hugging Face names the block `block_sparse_moe` and each expert's projections w1 (gate),
w3 (up) and w2 (down); routing renormalises the top_k probabilities.
"""

from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig

from workers.engine.attention import AttentionBackend
from workers.engine.models.llama import LlamaForCausalLM
from workers.engine.models.moe import SparseMoeBlock

# checkpoint projection name of an expert -> (our stacked projection, matrix index)
MIXTRAL_EXPERTS: dict[str, tuple[str, int]] = {"w1": ("w13", 0), "w3": ("w13", 1),
                                               "w2": ("w2", 0)}


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama attention and norms; `block_sparse_moe` in place of every MLP."""

    expert_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = MIXTRAL_EXPERTS

    def __init__(self, hf_config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__(hf_config, backend)
        for layer in self.model.layers:
            del layer.mlp
            layer.block_sparse_moe = SparseMoeBlock(
                hidden_size=hf_config.hidden_size,
                num_experts=hf_config.num_local_experts,
                top_k=hf_config.num_experts_per_tok,
                expert_intermediate_size=hf_config.intermediate_size,
                renormalize=True,
                pointwise=backend.pointwise,
            )
            # The layer's forward calls `mlp`; parameters keep the checkpoint's name, the
            # first one registered (named_parameters lists a shared module once).
            layer.mlp = layer.block_sparse_moe
