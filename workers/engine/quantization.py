"""Quantized checkpoints: which formats load, and their weights as plain matrices.

Responsible for reading `quantization_config` from config.json into a `QuantScheme`
(refusing, with the reason, what is not supported), and for turning each quantized
linear's tensors back into the (out, in) matrix it stands for, so the loader fills the
model as from any checkpoint. Supported:
- GPTQ, 4 or 8 bits, any group size (or -1: one group), act-order (`g_idx`), the
  original format (zeros stored minus one) and `gptq_v2`;
- AWQ GEMM, 4 bits, with zero points;
- FP8 e4m3 weights: compressed-tensors `float-quantized` (per-tensor, per-channel or
  block scales) and the `fp8` config (per-tensor `weight_scale` or block-wise
  `weight_scale_inv`).

Layouts, for a linear of `in` inputs and `out` outputs, b bits, p = 32 / b values per
int32, G groups:
- GPTQ: qweight (in / p, out), input i of column o in word i // p at bits (i % p) * b;
  qzeros (G, out / p), packed along the output; scales (G, out); g_idx (in,) the group of
  each input. w[o, i] = scales[g, o] * (q[i, o] - zero[g, o]) with g = g_idx[i], and
  zero = stored + 1 in the original format.
- AWQ: qweight (in, out / 8), column 8 c + ORDER[j] of row i at bits 4 j of word
  (i, c), ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros (G, out / 8) likewise; scales (G, out);
  groups are consecutive runs of `group_size` inputs. w[o, i] = scales[g, o] * (q - zero).
- FP8: weight (out, in) float8_e4m3fn times its scale (a scalar, (out, 1), or one per
  (block_out, block_in) tile; `weight_scale_inv` is such a multiplier despite its name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Suffixes of the tensors a quantized linear stores besides or instead of `weight`.
_INTEGER_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_FP8_SCALES = ("weight_scale", "weight_scale_inv")
_FP8_IGNORED = ("input_scale", "output_scale", "k_scale", "v_scale")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How a checkpoint's linears are stored; see the module docstring."""

    method: str  # gptq | awq | fp8
    bits: int = 8
    group_size: int = -1
    # GPTQ's original format stores each zero point minus one.
    zeros_offset: int = 0
    # FP8 block scales: (outputs, inputs) per scale, when the config names them.
    weight_block: tuple[int, int] | None = None


def quant_scheme_of(hf_config: Any) -> QuantScheme | None:
    """The scheme of `quantization_config`, None without one; ValueError naming what is
    not supported."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    method = str(config.get("quant_method", "")).lower()
    if method == "gptq":
        bits = int(config.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"model quantization gptq with {bits} bits is not supported "
                             "(4 or 8 bits)")
        checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"model quantization gptq in format {checkpoint_format!r} is not "
                             "supported (gptq, gptq_v2)")
        return QuantScheme("gptq", bits, int(config.get("group_size", 128)),
                           zeros_offset=1 if checkpoint_format == "gptq" else 0)
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        bits = int(config.get("bits", config.get("w_bit", 4)))
        if version != "gemm" or bits != 4 or not config.get("zero_point", True):
            raise ValueError("model quantization awq is supported as 4-bit GEMM with zero "
                             f"points; this one is {bits}-bit {version}"
                             f"{'' if config.get('zero_point', True) else ' without zeros'}")
        return QuantScheme("awq", 4, int(config.get("group_size", config.get("q_group_size",
                                                                                 128))))
    if method == "fp8" or (method == "compressed-tensors" and _is_fp8_weights(config)):
        return QuantScheme("fp8", weight_block=_fp8_block(config))
    raise ValueError(f"model quantization {method or config!r} is not supported; supported: "
                     "gptq (4/8-bit), awq (4-bit GEMM), fp8 (e4m3 weights)")


def _is_fp8_weights(config: dict[str, Any]) -> bool:
    """compressed-tensors with 8-bit float weights in every group (what this loads)."""
    groups = config.get("config_groups") or {}
    if config.get("format") not in ("float-quantized", "naive-quantized") or not groups:
        raise ValueError(f"model quantization compressed-tensors format "
                         f"{config.get('format')!r} is not supported (float-quantized FP8)")
    for group in groups.values():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
            raise ValueError("model quantization compressed-tensors is supported for 8-bit "
                             f"float weights; a group has {weights}")
    return True


def _fp8_block(config: dict[str, Any]) -> tuple[int, int] | None:
    """The FP8 scale block (outputs, inputs): `weight_block_size` of the fp8 config, or a
    compressed-tensors group's `block_structure`."""
    block = config.get("weight_block_size")
    for group in (config.get("config_groups") or {}).values():
        block = block or (group.get("weights") or {}).get("block_structure")
    if isinstance(block, str):  # compressed-tensors once wrote "128x128"
        block = block.lower().split("x")
    if not block:
        return None
    if len(block) != 2:
        raise ValueError(f"model quantization fp8 block {block!r} is not (outputs, inputs)")
    return int(block[0]), int(block[1])


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split each int32 into 32 / bits unsigned values, lowest bits first, along `dim`."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.to(torch.int32).unsqueeze(-1)  # (..., 1)
    values = (words >> shifts) & ((1 << bits) - 1)  # (..., per_word)
    if dim in (0, -packed.dim()):
        # (rows, cols, p) -> (rows, p, cols) -> (rows * p, cols)
        return values.movedim(-1, 1).reshape(packed.shape[0] * per_word, *packed.shape[1:])
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)


def dequantize_gptq(scheme: QuantScheme, qweight: torch.Tensor, qzeros: torch.Tensor,
                    scales: torch.Tensor, g_idx: torch.Tensor | None) -> torch.Tensor:
    """The (out, in) float32 matrix of a GPTQ linear."""
    q = unpack_int32(qweight, scheme.bits, dim=0)  # (in, out)
    zeros = unpack_int32(qzeros, scheme.bits, dim=1)[:, : q.shape[1]] + scheme.zeros_offset
    if g_idx is None:
        size = q.shape[0] if scheme.group_size == -1 else scheme.group_size
        g_idx = torch.arange(q.shape[0], device=q.device) // size
    g = g_idx.long()
    w = (q - zeros[g]).float() * scales.float()[g]  # (in, out)
    return w.t().contiguous()


def dequantize_awq(scheme: QuantScheme, qweight: torch.Tensor, qzeros: torch.Tensor,
                   scales: torch.Tensor) -> torch.Tensor:
    """The (out, in) float32 matrix of an AWQ GEMM linear."""
    reverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])
    q = unpack_int32(qweight, 4, dim=1)  # (in, out) in packing order
    q = q.view(q.shape[0], -1, 8)[..., reverse].reshape(q.shape)
    zeros = unpack_int32(qzeros, 4, dim=1)
    zeros = zeros.view(zeros.shape[0], -1, 8)[..., reverse].reshape(zeros.shape)
    g = torch.arange(q.shape[0]) // scheme.group_size
    w = (q - zeros[g]).float() * scales.float()[g]
    return w.t().contiguous()


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """The (out, in) float32 matrix of an FP8 linear with a scalar, per-row or block scale
    (blocks of `block`, or as many as the scale's shape implies)."""
    w = weight.float()
    scale = scale.float()
    if scale.numel() == 1 or (scale.dim() == 2 and scale.shape[1] == 1
                              and scale.shape[0] == w.shape[0]):
        return w * scale.reshape(-1, 1) if scale.numel() > 1 else w * scale.reshape(())
    if scale.dim() != 2:
        raise ValueError(f"FP8 weight scale of shape {tuple(scale.shape)} is not supported")
    block_out, block_in = block or fp8_scale_block(w.shape, scale.shape)
    full = scale.repeat_interleave(block_out, 0)[: w.shape[0]]
    return w * full.repeat_interleave(block_in, 1)[:, : w.shape[1]]


def fp8_scale_block(weight_shape: torch.Size | tuple[int, ...],
                    scale_shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(outputs, inputs) per scale of a 2-D block scale, from the shapes alone."""
    return -(-weight_shape[0] // scale_shape[0]), -(-weight_shape[1] // scale_shape[1])


def dequantized_tensors(
    scheme: QuantScheme | None, names: list[str], get: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a checkpoint with each quantized linear's parts replaced by its
    `<module>.weight` matrix; other tensors pass through."""
    present = set(names)
    for name in names:
        module, _, part = name.rpartition(".")
        if scheme is None:
            yield name, get(name)
        elif scheme.method in ("gptq", "awq") and part in _INTEGER_PARTS:
            if part != "qweight":
                continue
            parts = {p: get(f"{module}.{p}") for p in _INTEGER_PARTS if f"{module}.{p}" in present}
            if "qzeros" not in parts or "scales" not in parts:
                raise ValueError(f"quantized weight {name!r} lacks its qzeros or scales")
            if scheme.method == "gptq":
                w = dequantize_gptq(scheme, parts["qweight"], parts["qzeros"], parts["scales"],
                                    parts.get("g_idx"))
            else:
                w = dequantize_awq(scheme, parts["qweight"], parts["qzeros"], parts["scales"])
            yield f"{module}.weight", w
        elif scheme.method == "fp8" and part in _FP8_SCALES + _FP8_IGNORED:
            continue
        elif scheme.method == "fp8" and part == "weight":
            tensor = get(name)
            if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                yield name, tensor  # a layer left unquantized (the config's `ignore`)
                continue
            scale_name = next((f"{module}.{s}" for s in _FP8_SCALES if f"{module}.{s}" in present),
                              None)
            if scale_name is None:
                raise ValueError(f"FP8 weight {name!r} has no weight_scale")
            yield name, dequantize_fp8(tensor, get(scale_name), scheme.weight_block)
        else:
            yield name, get(name)
