"""The decoder's pointwise steps, as torch formulas or as fused CPU kernels.

One model serves every device: it asks its attention backend's `pointwise` for SwiGLU,
rotary and the residual add + RMSNorm. `TorchPointwise` is the eager formula (CUDA, and
the reference on the CPU); `CpuPointwise` runs kernels/cpu_pointwise.cpp, one pass per
step instead of a chain of ops that wrote and re-read each activation a dozen times per
layer. The CPU attention backend, which exists only where those kernels loaded, picks it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class TorchPointwise:
    """Eager torch: a few ops per step, any device."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, 2 I) -> silu(x[:, :I]) * x[:, I:], (N, I)."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(self, table: torch.Tensor, positions: torch.Tensor) -> Any:
        """What `rotate` needs for one forward pass: cos and signed sin per row, (N, 1, D)."""
        cos, sin = table[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def rotate(self, x: torch.Tensor, rope: Any) -> torch.Tensor:
        """x (N, heads, D) rotated NeoX style (see RotaryEmbedding), as a new tensor; with a
        table of R < D dimensions (partial rotary) the first R, the rest passed through."""
        cos, sin = rope
        rotated = cos.shape[-1]
        if rotated == x.shape[-1]:
            return x * cos + x.roll(rotated // 2, dims=-1) * sin
        head, rest = x[..., :rotated], x[..., rotated:]
        return torch.cat([head * cos + head.roll(rotated // 2, dims=-1) * sin, rest], dim=-1)

    def add_rms_norm(
        self, norm: Any, delta: torch.Tensor | None, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta); no delta: (norm(residual), residual)."""
        if delta is not None:
            residual = residual + delta
        return norm(residual), residual


class CpuPointwise(TorchPointwise):
    """The fused C++ kernels (`torch.ops.batchinfer_cpu`); cpu_kernels.load() must be None."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """One pass: each gate/up pair read once, the product written once."""
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        torch.ops.batchinfer_cpu.silu_and_mul(out, x)
        return out

    def rope(self, table: torch.Tensor, positions: torch.Tensor) -> Any:
        """The table and the positions themselves: the kernel looks rows up as it goes."""
        return table, positions

    def rotate(self, x: torch.Tensor, rope: Any) -> torch.Tensor:
        """x rotated in place (x is a view of this layer's fresh q/k projection)."""
        table, positions = rope
        torch.ops.batchinfer_cpu.rotary_embedding(x, positions, table)
        return x

    def add_rms_norm(
        self, norm: Any, delta: torch.Tensor | None, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum lands in `residual` itself (the forward pass owns it): one pass."""
        out = torch.empty_like(residual)
        torch.ops.batchinfer_cpu.add_rms_norm(out, residual, delta, norm.weight, norm.eps)
        return out, residual


TORCH_POINTWISE = TorchPointwise()
CPU_POINTWISE = CpuPointwise()
