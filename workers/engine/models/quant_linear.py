"""A projection whose weight stays quantized in memory (int4/int8 or FP8), run by the
dequantize-in-GEMM kernels (Triton; on the CPU, an int4 GEMM for 4 bits where one runs,
see `cpu_int4`); its output rows may stack several checkpoint matrices (q/k/v, gate/up)
as FusedLinear's do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine import cpu_int4
from workers.engine.kernels.interpreter import is_interpreting
from workers.engine.kernels.quant_gemm import fp8_weight_gemm, int_weight_gemm
from workers.engine.quantization import QuantScheme
from workers.engine.quantized_layouts import Fp8Weights, IntWeights


class QuantLinear(nn.Module):
    """x (..., in) -> (..., out) from packed weights; shapes fixed at construction so the
    module is built on the meta device and allocated with the rest of the model."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor
    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 scheme: QuantScheme, dtype: torch.dtype,
                 fp8_block: tuple[int, int] | None = None) -> None:
        super().__init__()
        n = sum(output_sizes)
        self.in_features, self.out_features = in_features, n
        self.output_sizes = output_sizes
        self.method = scheme.method
        self.bits = scheme.bits
        if scheme.method in ("gptq", "awq"):
            per_word = 32 // scheme.bits
            self.group_size = in_features if scheme.group_size == -1 else scheme.group_size
            groups = -(-in_features // self.group_size)
            self.register_buffer("qweight", torch.empty(in_features // per_word, n,
                                                        dtype=torch.int32))
            self.register_buffer("scales", torch.empty(groups, n))
            self.register_buffer("zeros", torch.empty(groups, n))
            self.register_buffer("perm", torch.empty(in_features, dtype=torch.int64))
            self.has_perm: bool | None = None  # known once the first shard is loaded
        else:
            block_n, block_k = fp8_block or (1, in_features)
            self.block_n, self.block_k = block_n, block_k
            self.register_buffer("weight", torch.empty(n, in_features, dtype=torch.float8_e4m3fn))
            self.register_buffer("scale", torch.empty(-(-n // block_n), -(-in_features // block_k)))
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype)) if bias else None
        # The CPU int4 kernel's copy (prepare_int4), or the dequantized matrix (keep_dequantized).
        self.int4: cpu_int4.Int4Weights | cpu_int4.TileInt4Weights | None = None
        self.dense: torch.Tensor | None = None

    def device(self) -> torch.device:
        """Where this projection's tensors live."""
        return (self.scale if self.method == "fp8" else self.scales).device

    def load_shard(self, shard: int | None, weights: IntWeights | Fp8Weights) -> None:
        """Copy one checkpoint matrix's packed tensors into its rows of this projection."""
        index = shard or 0
        start, size = sum(self.output_sizes[:index]), self.output_sizes[index]
        if isinstance(weights, IntWeights):
            self._load_int(start, size, weights)
        else:
            self._load_fp8(start, size, weights)

    def _load_int(self, start: int, size: int, w: IntWeights) -> None:
        _copy(self.qweight, 1, start, size, w.qweight)
        _copy(self.scales, 1, start, size, w.scales)
        _copy(self.zeros, 1, start, size, w.zeros)
        if self.has_perm is None:
            self.has_perm = w.perm is not None
            if w.perm is not None:
                self.perm.copy_(w.perm)
        elif self.has_perm != (w.perm is not None) or (
                w.perm is not None and not torch.equal(self.perm.cpu(), w.perm)):
            raise ValueError("the matrices of one fused projection have different act-order "
                             "input orders")

    def _load_fp8(self, start: int, size: int, w: Fp8Weights) -> None:
        if (w.block_n, w.block_k) != (self.block_n, self.block_k) and not (
                self.block_n == 1 and w.block_n == 1 and w.block_k >= self.in_features):
            raise ValueError(f"FP8 scale blocks {(w.block_n, w.block_k)} where "
                             f"{(self.block_n, self.block_k)} were planned")
        _copy(self.weight, 0, start, size, w.weight)
        _copy(self.scale, 0, start // self.block_n, -(-size // self.block_n), w.scale)

    def prepare_int4(self, dtype: torch.dtype) -> bool:
        """Keep a CPU int4 kernel's copy of the weights for activations of `dtype`, where one
        takes this projection (`cpu_int4`). Our kernel's copy replaces the int layout
        (`_values` reads it back), so the weights take half a byte each; torch's keeps the
        int layout beside it. Whether one did."""
        if self.method not in ("gptq", "awq") or self.bits != 4:
            return False
        self.int4 = cpu_int4.pack(self._values(), self.scales, self.zeros, self.group_size,
                                  dtype)
        if isinstance(self.int4, cpu_int4.TileInt4Weights) and not is_interpreting():
            self.qweight = self.qweight.new_empty(0, self.out_features)
        return self.int4 is not None

    def keep_dequantized(self, dtype: torch.dtype) -> None:
        """Run on the CPU from the dequantized matrix in `dtype`, made once here (where no
        int4 kernel takes this projection and memory is not what the user asked to save)."""
        self.dense = self.dequantized().to(dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out) in x's dtype."""
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cpu" and not is_interpreting():
            out = self._forward_cpu(flat)
        elif self.method == "fp8":
            out = fp8_weight_gemm(flat, self.weight, self.scale, block_n=self.block_n,
                                  block_k=self.block_k, bias=self.bias)
        else:
            out = int_weight_gemm(flat, self.qweight, self.scales, self.zeros, bits=self.bits,
                                  group_size=self.group_size, bias=self.bias,
                                  perm=self.perm if self.has_perm else None)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _forward_cpu(self, flat: torch.Tensor) -> torch.Tensor:
        """Without Triton: an int4 GEMM where prepared, else the dequantized matrix (kept, or
        made on every call)."""
        if self.int4 is None:
            dense = self.dense if self.dense is not None else self.dequantized().to(flat.dtype)
            return F.linear(flat, dense, self.bias)
        if self.has_perm:
            flat = flat.index_select(1, self.perm)  # inputs in sorted (group) order
        out = cpu_int4.matmul(flat, self.int4)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        """The (out, in) float32 matrix the packed weight stands for (reference, and the CPU
        without Triton)."""
        if self.method == "fp8":
            scale = self.scale.repeat_interleave(self.block_n, 0)[: self.out_features]
            scale = scale.repeat_interleave(self.block_k, 1)[:, : self.in_features]
            return self.weight.float() * scale
        q = self._values().float()  # (in, out), sorted inputs
        groups = torch.arange(self.in_features, device=q.device) // self.group_size
        w = (q - self.zeros[groups]) * self.scales[groups]
        if self.has_perm:
            w = torch.empty_like(w).index_copy_(0, self.perm, w)  # back to checkpoint order
        return w.t()

    def _values(self) -> torch.Tensor:
        """The (in, out) integer values of the int layout, inputs in sorted order."""
        if not self.qweight.numel() and isinstance(self.int4, cpu_int4.TileInt4Weights):
            return cpu_int4.tile_values(self.int4)
        per_word = 32 // self.bits
        shifts = torch.arange(0, 32, self.bits, dtype=torch.int32, device=self.qweight.device)
        q = ((self.qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << self.bits) - 1))
        return q.reshape(self.qweight.shape[0] * per_word, -1)


def _copy(target: torch.Tensor, dim: int, start: int, size: int, source: torch.Tensor) -> None:
    part = target.narrow(dim, start, size)
    if part.shape != source.shape:
        raise ValueError(f"quantized tensor of shape {tuple(source.shape)} where "
                         f"{tuple(part.shape)} was expected")
    part.copy_(source)
