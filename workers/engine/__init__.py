"""The inference engine: continuous batching over a paged KV cache, with prefix caching.

Public names are imported lazily, so that using the scheduling parts (sequence, scheduler,
block manager) does not pull in torch and the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.engine.config import EngineConfig
    from workers.engine.llm import LLM
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.outputs import EngineStats, RequestOutput
    from workers.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]

_WHERE = {
    "LLM": "workers.engine.llm",
    "LLMEngine": "workers.engine.llm_engine",
    "EngineConfig": "workers.engine.config",
    "EngineStats": "workers.engine.outputs",
    "RequestOutput": "workers.engine.outputs",
    "SamplingParams": "workers.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    """Import a public name on first use."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
