"""What the kernels' launchers adapt when Triton's interpreter runs them on the CPU."""

from __future__ import annotations

import os

import torch


def is_interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on CPU tensors through numpy (the tests' stand-in)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_options(dtype: torch.dtype) -> tuple[bool, str | None]:
    """(upcast, input_precision) of the kernels' `tl.dot` for inputs of `dtype`: numpy has
    no bf16 matmul, so the interpreter widens bf16 tiles to fp32; fp32 (or widened) dots run
    in IEEE precision, so results match a torch fp32 reference instead of TF32's."""
    upcast = is_interpreting() and dtype == torch.bfloat16
    return upcast, "ieee" if dtype == torch.float32 or upcast else None
