"""Quantized checkpoint tensors re-laid for the kernels that keep them quantized
(`kernels/quant_gemm.py`): one int layout for GPTQ and AWQ, one FP8 layout for every FP8
scale granularity. A layout returns None where a checkpoint's tensors do not fit it (the
loader then dequantizes that linear at load, as for the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.quantization import AWQ_ORDER, QuantScheme, fp8_scale_block, unpack_int32


@dataclass(slots=True)
class IntWeights:
    """qweight (K / p, N) int32, scales and zeros (G, N) float32, perm (K,) or None."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None


@dataclass(slots=True)
class Fp8Weights:
    """weight (N, K) float8_e4m3fn, scale (ceil(N / block_n), ceil(K / block_k)) float32."""

    weight: torch.Tensor
    scale: torch.Tensor
    block_n: int
    block_k: int


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(K, N) unsigned values -> (K / p, N) int32 words, row r * p + j at bits j * bits."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    grouped = values.to(torch.int64).view(-1, per_word, values.shape[1])
    words = (grouped << shifts.view(1, -1, 1)).sum(dim=1)  # disjoint bits: sum is an OR
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def act_order_perm(scheme: QuantScheme, g_idx: torch.Tensor | None,
                   k: int) -> torch.Tensor | None:
    """The input order that makes a GPTQ linear's groups runs of `group_size` inputs: None
    when they already are; ValueError when no order does (no GPTQ writer makes that)."""
    size = k if scheme.group_size == -1 else scheme.group_size
    in_order = torch.arange(k) // size
    if g_idx is None or torch.equal(g_idx.long(), in_order):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], in_order):
        raise ValueError("its act-order groups are not runs of group_size inputs")
    return perm


def gptq_int_weights(scheme: QuantScheme, qweight: torch.Tensor, qzeros: torch.Tensor,
                     scales: torch.Tensor, g_idx: torch.Tensor | None) -> IntWeights:
    """A GPTQ linear in the int layout, act-order inputs sorted by group."""
    n = qweight.shape[1]
    zeros = unpack_int32(qzeros, scheme.bits, dim=1)[:, :n] + scheme.zeros_offset
    perm = act_order_perm(scheme, g_idx, qweight.shape[0] * (32 // scheme.bits))
    if perm is not None:
        qweight = pack_rows(unpack_int32(qweight, scheme.bits, dim=0)[perm], scheme.bits)
    return IntWeights(qweight.to(torch.int32).contiguous(), scales.float().contiguous(),
                      zeros.float().contiguous(), perm)


def awq_int_weights(qweight: torch.Tensor, qzeros: torch.Tensor,
                    scales: torch.Tensor) -> IntWeights:
    """An AWQ GEMM linear (4 bits, columns packed in AWQ's order) in the int layout."""
    reverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])

    def columns_in_order(packed: torch.Tensor) -> torch.Tensor:
        values = unpack_int32(packed, 4, dim=1)
        return values.view(values.shape[0], -1, 8)[..., reverse].reshape(values.shape)

    q = columns_in_order(qweight)  # (K, N)
    return IntWeights(pack_rows(q, 4), scales.float().contiguous(),
                      columns_in_order(qzeros).float().contiguous(), None)


def fp8_weights(weight: torch.Tensor, scale: torch.Tensor,
                block: tuple[int, int] | None = None) -> Fp8Weights | None:
    """An e4m3 linear with a scalar, per-row or block scale in the FP8 layout (None for an
    e5m2 weight or a scale of another shape)."""
    if weight.dtype != torch.float8_e4m3fn:
        return None
    n, k = weight.shape
    scale = scale.float()
    if scale.numel() == 1 or tuple(scale.shape) in ((n,), (n, 1)):
        # One scale per output row, the scalar repeated: fused neighbours may differ.
        return Fp8Weights(weight.contiguous(), scale.reshape(-1, 1).expand(n, 1).contiguous(),
                          1, k)
    if scale.dim() != 2:
        return None
    block_n, block_k = block or fp8_scale_block(weight.shape, scale.shape)
    if block_k % 16:
        return None
    return Fp8Weights(weight.contiguous(), scale.contiguous(), block_n, block_k)
