"""Which `model_type` each family class serves: the one place that decides support."""

from __future__ import annotations

from transformers import PretrainedConfig

from workers.engine.model_types import unsupported_type_reason
from workers.engine.models.base import CausalLM
from workers.engine.models.gemma import GemmaForCausalLM
from workers.engine.models.llama import LlamaForCausalLM
from workers.engine.models.mixtral import MixtralForCausalLM
from workers.engine.models.phi3 import Phi3ForCausalLM
from workers.engine.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from workers.engine.models.qwen3 import Qwen3ForCausalLM
from workers.engine.quantization import quant_scheme_of

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}
SUPPORTED_MODEL_TYPES = frozenset(MODEL_CLASSES)


def model_class_for(hf_config: PretrainedConfig) -> type[CausalLM]:
    """The class that runs this config; ValueError naming the reason when none can."""
    check_supported(hf_config)
    return MODEL_CLASSES[hf_config.model_type]


def check_supported(hf_config: PretrainedConfig) -> None:
    """Raise ValueError naming `model` for architectures this engine cannot run."""
    model_type = getattr(hf_config, "model_type", None)
    model_class = MODEL_CLASSES.get(model_type) if isinstance(model_type, str) else None
    if model_class is None:
        raise ValueError(unsupported_type_reason(model_type))
    model_class.check_config(hf_config)  # rope kind, layer types, activation
    quant_scheme_of(hf_config)  # raises for unsupported quantization formats
