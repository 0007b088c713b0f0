"""The `model_type`s the engine serves, as names only: readable without importing torch.

`workers.engine.models.registry` maps each to its family class (a test holds the two
equal); `up` reads this list to refuse a model of another family before it starts
anything, while the full check still waits for the warm server's imports.
"""

from __future__ import annotations

SERVED_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral",
    "qwen2_moe", "qwen3_moe",
})


def unsupported_type_reason(model_type: object) -> str:
    """Why a config of this `model_type` cannot be served (the engine's one wording)."""
    return (f"model architecture {model_type!r} is not supported; "
            f"supported: {sorted(SERVED_MODEL_TYPES)}")
