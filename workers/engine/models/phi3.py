"""Phi-3 / Phi-3.5: the Llama layout, with q/k/v and gate/up already packed in the
checkpoint (`qkv_proj`, `gate_up_proj`, in the same row order as ours) and longrope
scaling (handled by rotary.py)."""

from __future__ import annotations

from typing import ClassVar

from workers.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 mini/medium and Phi-3.5 mini: the checkpoint's packed matrices load as they are."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}
