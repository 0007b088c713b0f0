"""How an encoder's token states become one vector, as its sentence-transformers files say.

A sentence-transformers directory lists its modules in `modules.json` (Transformer,
Pooling, optionally Normalize), the pooling mode in `<pooling dir>/config.json` and the
training length in `sentence_bert_config.json`. A bare encoder directory (no modules.json)
gets mean pooling without normalisation, the most common choice for such checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len", "lasttoken")
# sentence-transformers' Pooling config flag → our mode name.
_MODE_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """Pooling mode, whether vectors are L2-normalised, and the longest input in tokens."""

    mode: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {', '.join(POOLING_MODES)}, "
                             f"got {self.mode!r}")


def read_pooling_config(model_dir: Path) -> PoolingConfig:
    """The pooling a model directory asks for (see the module docstring)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig()
    modules = json.loads(modules_file.read_text())
    types = [str(m.get("type", "")) for m in modules]
    mode = "mean"
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            config_file = model_dir / str(module.get("path", "")) / "config.json"
            if config_file.is_file():
                mode = _mode_of(json.loads(config_file.read_text()))
    max_seq_length = None
    st_config = model_dir / "sentence_bert_config.json"
    if st_config.is_file():
        max_seq_length = json.loads(st_config.read_text()).get("max_seq_length")
    return PoolingConfig(mode=mode, normalize=any(t.endswith("Normalize") for t in types),
                         max_seq_length=max_seq_length)


def _mode_of(config: dict[str, object]) -> str:
    # Several flags at once concatenate vectors in sentence-transformers; one is the norm.
    modes = [mode for flag, mode in _MODE_FLAGS.items() if config.get(flag)]
    if len(modes) != 1:
        raise ValueError(f"pooling config must enable exactly one mode, found {modes or 'none'}")
    return modes[0]


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """Token states (B, T, H) and mask (B, T) → one vector per row (B, H), in float32.

    Rows are right-padded: row b holds attention_mask[b].sum() real tokens first.
    """
    hidden = hidden.float()
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    lengths = mask.sum(dim=1).clamp(min=1.0)  # (B, 1)
    if config.mode == "cls":
        pooled = hidden[:, 0]
    elif config.mode == "max":
        pooled = hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values
    elif config.mode == "lasttoken":
        last = attention_mask.sum(dim=1).long() - 1  # (B,)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    else:
        summed = (hidden * mask).sum(dim=1)
        pooled = summed / (lengths.sqrt() if config.mode == "mean_sqrt_len" else lengths)
    if config.normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
    return pooled
