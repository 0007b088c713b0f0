"""Reading the fields of a Hugging Face config that families spell differently."""

from __future__ import annotations

from transformers import PretrainedConfig


def head_dim_of(hf_config: PretrainedConfig) -> int:
    """Per-head size: explicit `head_dim`, else hidden_size / num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


def num_kv_heads_of(hf_config: PretrainedConfig) -> int:
    """Key/value heads: `num_key_value_heads`, else one per query head (no GQA)."""
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def kv_window(hf_config: PretrainedConfig) -> int | None:
    """The widest sliding window when every layer has one: keys further back than it are
    never read again. None when any layer attends to the whole sequence (Gemma's global
    layers) or none has a window."""
    windows = layer_windows(hf_config)
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def layer_windows(hf_config: PretrainedConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention).

    Configs with `layer_types` (Qwen2/3, Gemma 2/3) window the "sliding_attention" layers;
    those without (Mistral, Phi-3) window every layer when `sliding_window` is set. Qwen2's
    config leaves `sliding_window` None unless `use_sliding_window` is on.
    """
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"model layer_types {unknown} are not supported")
        if len(layer_types) != num_layers:
            raise ValueError(f"model layer_types has {len(layer_types)} entries for "
                             f"{num_layers} layers")
    if not window:
        return [None] * num_layers
    if int(window) < 1:
        raise ValueError(f"model sliding_window must be >= 1, got {window}")
    if layer_types is None:
        return [int(window)] * num_layers
    return [int(window) if t == "sliding_attention" else None for t in layer_types]
