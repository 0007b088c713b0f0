"""Where and how the model runs: the device, the dtype and the attention backend.

On CUDA the attention backend is flash-attn where it is installed and can run (sm80+,
fp16/bf16), else this project's Triton kernels (Triton ships with torch's CUDA wheels);
the torch path on CUDA is a last resort, announced with a WARNING. The CPU runs this
project's C++ decode kernel (built on first use, cpu_kernels.py), else the torch path;
Triton there only under its interpreter, for tests.
"""

from __future__ import annotations

import logging

import torch
from transformers import PretrainedConfig

from workers.engine import cpu_int4, cpu_kernels
from workers.engine.attention import AttentionBackend, TorchAttentionBackend
from workers.engine.cpu_attention import CpuAttentionBackend
from workers.engine.flash_attention import (
    HAS_FLASH_ATTN,
    MIN_FLASH_CAPABILITY,
    FlashAttentionBackend,
)
from workers.engine.kernels.interpreter import is_interpreting
from workers.engine.kv_dtypes import FP8_KV
from workers.engine.models import head_dim_of
from workers.engine.quantization import quant_scheme_of
from workers.engine.triton_attention import HAS_TRITON, TritonAttentionBackend

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Native e4m3 conversions on CUDA (what Triton's fp8e4nv needs).
MIN_FP8_CAPABILITY = (8, 9)


def pick_device(name: str) -> torch.device:
    """auto: CUDA when available, else CPU. A CUDA device always carries its index (the
    current device's when none is named): `torch.cuda.set_device` refuses one without."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def pick_dtype(name: str, hf_config: PretrainedConfig, device: torch.device, *,
               quantized_weights: str = "auto") -> torch.dtype:
    """auto: fp32 on CPU, but bf16 for a 4-bit GPTQ/AWQ checkpoint kept packed where our
    int4 kernel runs (x86-64 with AVX2: it keeps such a model at half a byte a weight and
    decodes faster than bf16, see `cpu_int4`); on CUDA the checkpoint's half type, else
    bfloat16."""
    if name != "auto":
        return _DTYPES[name]
    if device.type != "cuda":
        scheme = quant_scheme_of(hf_config)
        if (scheme is not None and scheme.method in ("gptq", "awq") and scheme.bits == 4
                and quantized_weights != "dequantize" and cpu_int4.has_tile_kernel()):
            return torch.bfloat16
        return torch.float32
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = _DTYPES.get(saved)
    return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16


def packing_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype projections run in from oneDNN-packed weights, or None for F.linear.

    On the CPU fp32 is packed as is, and so are bf16/fp16 where the CPU has oneDNN's
    instructions for them (bf16: AVX-512 BW/VL/DQ or AVX-NE-CONVERT; fp16: AVX-512 FP16 or
    AMX). Elsewhere oneDNN refuses to pack them and torch's half-precision GEMM runs 4-7x
    slower than fp32, so their weights are packed as fp32 (exact) and each product is
    rounded back: fp32 speed for twice the packed copy's memory. CUDA's cuBLAS needs no
    packing.
    """
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return dtype
    if dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return dtype
    return torch.float32


def pick_kv_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype: the model's for "auto"; e4m3 for "fp8", which a CUDA device
    converts natively from compute capability 8.9 (Ada, Hopper) on."""
    if name == "auto":
        return dtype
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_FP8_CAPABILITY:
            raise ValueError(f"kv_cache_dtype {name!r} needs compute capability 8.9 or later "
                             f"(Ada, Hopper); {device} has {capability[0]}.{capability[1]}")
    return FP8_KV


def pick_backend(
    name: str, device: torch.device, dtype: torch.dtype, hf_config: PretrainedConfig,
    kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """auto: on CUDA flash-attn (fp16/bf16, sm80+) when installed, else Triton; on the CPU
    the C++ kernel when it builds, else torch. flash-attn does not read an fp8 KV pool
    (`kv_dtype`), nor the C++ kernel for fp16 models."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = head_dim_of(hf_config)
    fp8 = kv_dtype == FP8_KV
    if name == "torch":
        return TorchAttentionBackend(heads, kv_heads, head_dim)
    if name == "cpu" or name == "auto" and device.type == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU, not on {device}")
        error = cpu_kernels.load()
        if fp8 and dtype == torch.float16:
            error = "it reads an fp8 KV cache for float32 and bfloat16 models only"
        if error is None:
            return CpuAttentionBackend(heads, kv_heads, head_dim)
        if name == "cpu":
            raise ValueError(f"attention_backend 'cpu' cannot run here: {error}")
        return TorchAttentionBackend(heads, kv_heads, head_dim)
    if name == "flash" or name == "auto" and device.type == "cuda":
        reason = "it does not read an fp8 KV cache" if fp8 else _flash_unusable(device, dtype)
        if reason is None:
            return FlashAttentionBackend(heads, kv_heads, head_dim)
        if name == "flash":
            raise ValueError(f"attention_backend 'flash' cannot run here: {reason}")
        logger.info("flash attention not used: %s", reason)
    if name == "triton" or name == "auto" and device.type == "cuda":
        if HAS_TRITON and (device.type == "cuda" or is_interpreting()):
            return TritonAttentionBackend(heads, kv_heads, head_dim)
        if name == "triton":
            raise ValueError(
                "attention_backend 'triton' needs CUDA and the triton package (it comes with "
                "torch's CUDA wheels)"
            )
        logger.warning(
            "CUDA without flash-attn or Triton: falling back to torch paged attention, "
            "without CUDA graphs and several times slower; install torch's CUDA wheel "
            "(which brings triton)"
        )
    return TorchAttentionBackend(heads, kv_heads, head_dim)


def _flash_unusable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why flash-attn cannot run here, or None when it can."""
    if device.type != "cuda":
        return "it needs CUDA"
    if not HAS_FLASH_ATTN:
        return "the flash-attn package is not installed (see the README)"
    if dtype not in (torch.float16, torch.bfloat16):
        return "dtype must be float16 or bfloat16"
    if torch.cuda.get_device_capability(device) < MIN_FLASH_CAPABILITY:
        return "it needs a GPU of compute capability 8.0 or newer"
    return None


