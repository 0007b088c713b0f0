"""Tiny quantized checkpoints written here from the formats' specifications.

Each builder quantizes the linears of a saved random-weight Llama (attention and MLP
projections; embeddings, norms and lm_head stay as they are, as real quantizers leave
them), packs them as the format lays them out, and returns the matrices the packed values
stand for, computed from the integer values themselves (not by unpacking), so a packing
or unpacking mistake on either side shows up as a mismatch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit words -> the same bits as int32."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C) unsigned values -> (R / p, C) words: row r * p + j at bits j * bits."""
    per = 32 // bits
    words = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for j in range(per):
        words |= values[j::per].long() << (j * bits)
    return _as_int32(words)


def _pack_cols(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """(R, C) -> (R, C / p) words: column c * p + order[j] at bits j * bits."""
    per = 32 // bits
    order = order or list(range(per))
    words = torch.zeros(values.shape[0], values.shape[1] // per, dtype=torch.int64)
    for j in range(per):
        words |= values[:, order[j]::per].long() << (j * bits)
    return _as_int32(words)


def _quantize_groups(w: torch.Tensor, groups: torch.Tensor, num_groups: int, bits: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of w (out, in) with input i in group groups[i]:
    (q (in, out) ints, zeros (G, out) ints, scales (G, out) fp16)."""
    top = 2**bits - 1
    scales = torch.empty(num_groups, w.shape[0])
    zeros = torch.empty(num_groups, w.shape[0], dtype=torch.int64)
    for g in range(num_groups):
        cols = w[:, groups == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        scales[g] = ((hi - lo) / top).clamp(min=1e-4)
        zeros[g] = torch.round(-lo / scales[g]).clamp(0, top).long()
    scales = scales.half()
    q = torch.round(w.t() / scales.float()[groups] + zeros[groups]).clamp(0, top).long()
    return q, zeros, scales


Convert = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _rewrite(model_dir: Path, quantize: dict[str, object],
             convert: Convert) -> dict[str, torch.Tensor]:
    """Replace every linear's weight by what `convert(name, w)` returns (tensors to store,
    the matrix they mean); write config.json's quantization_config. Returns name -> matrix."""
    path = model_dir / "model.safetensors"
    state = load_file(path)
    meant: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            stored, matrix = convert(module, tensor)
            out.update(stored)
            meant[name] = matrix
        else:
            out[name] = tensor
    save_file(out, str(path), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantize
    (model_dir / "config.json").write_text(json.dumps(config))
    return meant


def write_gptq(model_dir: Path, *, bits: int, group_size: int, act_order: bool,
               seed: int = 0) -> dict[str, torch.Tensor]:
    """GPTQ (original format: zeros stored minus one), optionally with act-order g_idx."""
    gen = torch.Generator().manual_seed(seed)

    def convert(module: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w = w.float()
        size = w.shape[1] if group_size == -1 else group_size
        num_groups = w.shape[1] // size
        order = torch.randperm(w.shape[1], generator=gen) if act_order else torch.arange(w.shape[1])
        groups = torch.empty(w.shape[1], dtype=torch.int64)
        groups[order] = torch.arange(w.shape[1]) // size
        q, zeros, scales = _quantize_groups(w, groups, num_groups, bits)
        stored = {
            f"{module}.qweight": _pack_rows(q, bits),
            f"{module}.qzeros": _pack_cols(zeros - 1, bits),
            f"{module}.scales": scales,
            f"{module}.g_idx": groups.to(torch.int32),
        }
        matrix = ((q - zeros[groups]).float() * scales.float()[groups]).t()
        return stored, matrix

    return _rewrite(model_dir, {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                "desc_act": act_order, "sym": False}, convert)


def write_awq(model_dir: Path, *, group_size: int) -> dict[str, torch.Tensor]:
    """AWQ GEMM, 4 bits, zero points, columns in AWQ's interleaved packing order."""

    def convert(module: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w = w.float()
        groups = torch.arange(w.shape[1]) // group_size
        q, zeros, scales = _quantize_groups(w, groups, w.shape[1] // group_size, 4)
        stored = {
            f"{module}.qweight": _pack_cols(q, 4, AWQ_ORDER),
            f"{module}.qzeros": _pack_cols(zeros, 4, AWQ_ORDER),
            f"{module}.scales": scales,
        }
        return stored, ((q - zeros[groups]).float() * scales.float()[groups]).t()

    return _rewrite(model_dir, {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                "zero_point": True, "version": "gemm"}, convert)


def write_fp8(model_dir: Path, *, strategy: str) -> dict[str, torch.Tensor]:
    """FP8 e4m3 weights: compressed-tensors per tensor or channel, or `fp8` with 32x32
    blocks (`weight_scale_inv`)."""

    def convert(module: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w = w.float()
        if strategy == "block":
            tiles = w.unflatten(0, (-1, 32)).unflatten(2, (-1, 32))  # (O/32, 32, I/32, 32)
            scale = tiles.abs().amax(dim=(1, 3)) / 448.0  # (O/32, I/32)
            full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
            fp8 = (w / full).to(torch.float8_e4m3fn)
            return ({f"{module}.weight": fp8, f"{module}.weight_scale_inv": scale},
                    fp8.float() * full)
        scale = (w.abs().amax() if strategy == "tensor" else w.abs().amax(1, keepdim=True)) / 448
        fp8 = (w / scale).to(torch.float8_e4m3fn)
        return ({f"{module}.weight": fp8, f"{module}.weight_scale": scale.float(),
                 f"{module}.input_scale": torch.ones(())}, fp8.float() * scale)

    if strategy == "block":
        config: dict[str, object] = {"quant_method": "fp8", "weight_block_size": [32, 32],
                                     "activation_scheme": "dynamic"}
    else:
        config = {"quant_method": "compressed-tensors", "format": "float-quantized",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 8, "type": "float", "strategy": strategy}}},
                  "ignore": ["lm_head"]}
    return _rewrite(model_dir, config, convert)
