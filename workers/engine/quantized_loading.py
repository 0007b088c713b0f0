"""Which projections of a quantized checkpoint stay quantized in memory, and loading them.

A projection stays packed (a QuantLinear) when every checkpoint matrix stacked into it is
quantized in a layout the kernels run: GPTQ/AWQ ints whose act-order (if any) is one input
order for all of them, FP8 e4m3 with scale blocks that line up with the stacked rows.
Anything else (expert weights, a half-quantized fused projection, e5m2) is dequantized at
load as on the CPU, so a checkpoint never fails for lack of a kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

from workers.engine.models.linear import FusedLinear, Linear
from workers.engine.models.quant_linear import QuantLinear
from workers.engine.quantization import QuantScheme, fp8_scale_block
from workers.engine.quantized_layouts import (
    Fp8Weights,
    IntWeights,
    act_order_perm,
    awq_int_weights,
    fp8_weights,
    gptq_int_weights,
)

Getter = Callable[[str], torch.Tensor]
# (checkpoint tensor name) -> (our parameter name, shard) or None: the loader's mapping.
TargetOf = Callable[[str], "tuple[str, int | None] | None"]

_INT_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_FP8_PARTS = ("weight", "weight_scale", "weight_scale_inv", "input_scale", "output_scale")


@dataclass(slots=True)
class PackedProjection:
    """One of our projections kept quantized: checkpoint module per shard."""

    name: str
    sources: dict[int | None, str] = field(default_factory=dict)
    fp8_block: tuple[int, int] | None = None


def plan_packed(model: torch.nn.Module, scheme: QuantScheme, names: list[str],
                get: Getter, dtype_of: Callable[[str], str],
                target_of: TargetOf) -> list[PackedProjection]:
    """The projections to keep packed; see the module docstring."""
    present = set(names)
    candidates: dict[str, PackedProjection] = {}
    for name in names:
        module, _, part = name.rpartition(".")
        if not _is_quantized(scheme, module, part, present, dtype_of):
            continue
        target = target_of(f"{module}.weight")
        if target is None:
            continue
        param, shard = target
        ours = param.rsplit(".", 1)[0]
        if not isinstance(model.get_submodule(ours), Linear):
            continue  # expert stacks and the like: dequantized at load
        candidates.setdefault(ours, PackedProjection(ours)).sources[shard] = module
    plans = []
    for plan in candidates.values():
        linear = cast(Linear, model.get_submodule(plan.name))
        shards = (set(range(len(linear.output_sizes))) if isinstance(linear, FusedLinear)
                  else {None})
        if set(plan.sources) != shards:
            continue
        if scheme.method == "fp8":
            plan.fp8_block = _common_fp8_block(scheme, linear, plan, get, present)
            if plan.fp8_block == (0, 0):
                continue
        elif not _int_layouts_agree(scheme, plan, get, present):
            continue
        plans.append(plan)
    return plans


def _is_quantized(scheme: QuantScheme, module: str, part: str, present: set[str],
                  dtype_of: Callable[[str], str]) -> bool:
    if scheme.method in ("gptq", "awq"):
        return part == "qweight" and all(f"{module}.{p}" in present for p in ("qzeros", "scales"))
    return (part == "weight" and dtype_of(f"{module}.weight") == "F8_E4M3"
            and any(f"{module}.{s}" in present for s in ("weight_scale", "weight_scale_inv")))


def _fp8_scale_name(module: str, present: set[str]) -> str:
    plain = f"{module}.weight_scale"
    return plain if plain in present else f"{module}.weight_scale_inv"


def _common_fp8_block(scheme: QuantScheme, linear: Linear, plan: PackedProjection,
                      get: Getter, present: set[str]) -> tuple[int, int] | None:
    """None for scales per row, the (outputs, inputs) block shared by every shard, or
    (0, 0) when the shards' scales cannot sit in one tensor."""
    blocks: set[tuple[int, int] | None] = set()
    for module in plan.sources.values():
        weight = get(f"{module}.weight")
        scale = get(_fp8_scale_name(module, present))
        if scale.numel() == 1 or tuple(scale.shape) in ((weight.shape[0],), (weight.shape[0], 1)):
            blocks.add(None)
        else:
            blocks.add(scheme.weight_block or fp8_scale_block(weight.shape, scale.shape))
    if len(blocks) != 1:
        return (0, 0)
    block = blocks.pop()
    if block is None:
        return None
    sizes = getattr(linear, "output_sizes", [linear.out_features])
    if block[1] % 16 or (len(sizes) > 1 and any(size % block[0] for size in sizes)):
        return (0, 0)
    return block


def _int_layouts_agree(scheme: QuantScheme, plan: PackedProjection, get: Getter,
                       present: set[str]) -> bool:
    """Every shard fits the int layout, with one act-order input order among them."""
    if scheme.method == "awq":
        return True
    orders = []
    for module in plan.sources.values():
        g_idx = get(f"{module}.g_idx") if f"{module}.g_idx" in present else None
        k = get(f"{module}.qweight").shape[0] * (32 // scheme.bits)
        try:
            orders.append(act_order_perm(scheme, g_idx, k))
        except ValueError:
            return False
    first = orders[0]
    return all(o is None if first is None else (o is not None and torch.equal(o, first))
               for o in orders)


def swap_in_packed(model: torch.nn.Module, plans: list[PackedProjection], scheme: QuantScheme,
                   dtype: torch.dtype) -> None:
    """Replace each planned projection (still on the meta device) by a QuantLinear."""
    for plan in plans:
        linear = cast(Linear, model.get_submodule(plan.name))
        sizes = list(getattr(linear, "output_sizes", [linear.out_features]))
        model.set_submodule(plan.name, QuantLinear(
            linear.in_features, sizes, linear.bias is not None, scheme, dtype, plan.fp8_block))


def packed_source_names(plans: list[PackedProjection], present: set[str]) -> set[str]:
    """The checkpoint tensors the packed projections take (their biases load as usual)."""
    parts = _INT_PARTS + _FP8_PARTS
    return {f"{module}.{p}" for plan in plans for module in plan.sources.values()
            for p in parts if f"{module}.{p}" in present}


def load_packed(model: torch.nn.Module, plans: list[PackedProjection], scheme: QuantScheme,
                get: Getter, present: set[str]) -> None:
    """Fill every QuantLinear from its checkpoint matrices, re-laid for the kernels."""
    for plan in plans:
        projection = model.get_submodule(plan.name)
        assert isinstance(projection, QuantLinear)
        device = projection.device()
        for shard, module in plan.sources.items():
            weights = _layout(scheme, module, get, present, plan.fp8_block)
            projection.load_shard(shard, _to(weights, device))


def _layout(scheme: QuantScheme, module: str, get: Getter, present: set[str],
            block: tuple[int, int] | None) -> IntWeights | Fp8Weights:
    if scheme.method == "awq":
        return awq_int_weights(get(f"{module}.qweight"), get(f"{module}.qzeros"),
                               get(f"{module}.scales"))
    if scheme.method == "gptq":
        g_idx = get(f"{module}.g_idx") if f"{module}.g_idx" in present else None
        return gptq_int_weights(scheme, get(f"{module}.qweight"), get(f"{module}.qzeros"),
                                get(f"{module}.scales"), g_idx)
    fp8 = fp8_weights(get(f"{module}.weight"), get(_fp8_scale_name(module, present)), block)
    if fp8 is None:
        raise ValueError(f"FP8 weight {module!r} does not fit the FP8 kernel's layout")
    return fp8


def _to(weights: IntWeights | Fp8Weights, device: torch.device) -> IntWeights | Fp8Weights:
    if isinstance(weights, IntWeights):
        return IntWeights(weights.qweight.to(device), weights.scales.to(device),
                          weights.zeros.to(device),
                          None if weights.perm is None else weights.perm.to(device))
    return Fp8Weights(weights.weight.to(device), weights.scale.to(device), weights.block_n,
                      weights.block_k)
