"""Per-layer attention settings (sliding window, soft-capping, scale) in every CPU-side
backend, against the torch reference of the kernels (kernels/reference.py).

Steps mix decodes and prefill chunks with and without a cached prefix; windows of 1, 5
and 24 tokens cut through blocks, tiles and chunks at every offset the shapes produce.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.unit.engine import flash_standin
from workers.engine import cpu_kernels
from workers.engine.attention import AttentionBackend, AttentionParams, BatchLayout
from workers.engine.attention import TorchAttentionBackend as TorchBackend
from workers.engine.cpu_attention import CpuAttentionBackend
from workers.engine.flash_attention import FlashAttentionBackend
from workers.engine.kernels.reference import paged_attention_reference

# (cached, new) per sequence, decodes first by length as the runner orders rows.
STEP = [(0, 1), (4, 1), (23, 1), (40, 1), (70, 1), (200, 1), (0, 12), (20, 7), (3, 45),
        (30, 33)]  # fmt: skip
PARAMS = [
    AttentionParams(sliding_window=24),
    AttentionParams(sliding_window=5, softcap=3.0),
    AttentionParams(sliding_window=1),
    AttentionParams(softcap=2.0, scale=0.5),
]
IDS = ["window24", "window5-softcap", "window1", "softcap-scale"]


def run_step(
    backend: AttentionBackend, params: AttentionParams, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(backend output, reference) for STEP, both (N, H * D) fp32."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = backend.num_heads, backend.num_kv_heads, backend.head_dim
    needed = [-(-(c + n) // block_size) for c, n in STEP]
    ids = list(range(sum(needed)))
    random.Random(3).shuffle(ids)
    tables = []
    for n in needed:
        tables.append(ids[:n])
        ids = ids[n:]
    k_cache = torch.randn(sum(needed), block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype)
    num_tokens = sum(n for _, n in STEP)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    slots: list[int] = []
    for (c, n), table in zip(STEP, tables, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    width = max(needed)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor([n for _, n in STEP]).cumsum(0).tolist()],
                      dtype=torch.int32)
    seq_lens = [c + n for c, n in STEP]
    scale = head_dim**-0.5 if params.scale is None else params.scale
    ref = paged_attention_reference(
        q, k, v, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), padded,
        scale, params.sliding_window or 0, params.softcap or 0.0,
    ).reshape(num_tokens, -1)  # fmt: skip
    layout = BatchLayout(
        query_lens=[n for _, n in STEP], seq_lens=seq_lens, block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=sum(1 for _, n in STEP if n == 1), block_size=block_size, dtype=dtype,
    )  # fmt: skip
    meta = backend.build_metadata(layout, torch.device("cpu"))
    out = backend.forward(q, k, v, k_cache, v_cache, meta, params)
    return out.float(), ref


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_torch_backend_applies_layer_params(params: AttentionParams, block_size: int) -> None:
    """Windowed and soft-capped masks in decode groups, fresh and continued chunks."""
    out, ref = run_step(TorchBackend(6, 2, 16), params, block_size, torch.float32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
@pytest.mark.parametrize("dims", [(6, 2, 16), (8, 2, 64), (4, 2, 24)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_apply_layer_params(
    params: AttentionParams, dims: tuple[int, int, int], dtype: torch.dtype
) -> None:
    """The C++ decode walks (generic and compiled 64/G4) and prefill tiles; head size 24
    sends chunks through torch."""
    if cpu_kernels.load() is not None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.load()}")
    out, ref = run_step(CpuAttentionBackend(*dims), params, 16, dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("params", PARAMS, ids=IDS)
def test_flash_backend_passes_window_and_softcap(
    params: AttentionParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flash-attn's window_size (left = window - 1) and softcap, through the stand-in
    (fp16: flash-attn takes no fp32)."""
    flash_standin.install(monkeypatch)
    out, ref = run_step(FlashAttentionBackend(6, 2, 16), params, 256, torch.float16)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
