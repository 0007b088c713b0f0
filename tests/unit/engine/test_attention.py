"""Paged attention backends against dense causal attention computed in float64."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.cuda._utils import _get_device_index
from transformers import LlamaConfig

from tests.unit.engine.checkpoints import TINY, make_seq, place, save_llama
from workers.engine import cpu_kernels, placement
from workers.engine.attention import (
    AttentionBackend,
    BatchLayout,
    TorchAttentionBackend,
    to_pool,
    write_kv,
)
from workers.engine.config import EngineConfig
from workers.engine.cpu_attention import CpuAttentionBackend
from workers.engine.flash_attention import HAS_FLASH_ATTN, FlashAttentionBackend
from workers.engine.kv_dtypes import FP8_KV
from workers.engine.model_runner import ModelRunner
from workers.engine.placement import pick_backend
from workers.engine.triton_attention import TritonAttentionBackend

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16
# (cached tokens, new tokens) per sequence: decodes of many lengths, then chunks with and
# without a cached prefix.
SHAPES = [(0, 1), (1, 1), (4, 1), (16, 1), (39, 1), (40, 1), (99, 1), (0, 12), (20, 7), (3, 30)]


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int
) -> torch.Tensor:
    """q (n, H, D) over k/v (L, Hkv, D), query j at position num_cached + j; float64."""
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # (L, H, D)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * head_dim**-0.5
    n, length = q.shape[0], k.shape[0]
    allowed = torch.arange(length)[None, :] <= (num_cached + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).reshape(n, heads * head_dim)


def run_backend(
    backend: AttentionBackend,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    step_shapes: list[tuple[int, int]] = SHAPES,
    pool_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One paged step over (cached, new) step_shapes; returns (output, float64 reference).

    With `pool_dtype` (fp8) the pool stores that, and the reference attends keys and
    values rounded through it."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = backend.num_heads, backend.num_kv_heads, backend.head_dim
    # Rows ordered as the runner orders them: single queries first, shortest first.
    shapes = sorted((s for s in step_shapes if s[1] == 1), key=lambda s: s[0])
    shapes += [s for s in step_shapes if s[1] != 1]
    seq_lens = [c + n for c, n in shapes]
    needed = [-(-n // block_size) for n in seq_lens]
    ids = list(range(sum(needed)))
    random.Random(1).shuffle(ids)
    tables = []
    for n in needed:
        tables.append(ids[:n])
        ids = ids[n:]
    num_blocks = sum(needed) + 1
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=pool_dtype or dtype,
                          device=device)
    v_cache = torch.zeros_like(k_cache)
    qs, ks, vs, slots, refs = [], [], [], [], []
    for (c, n), table in zip(shapes, tables, strict=True):
        length = c + n
        q = torch.randn(n, heads, head_dim, generator=gen)
        k = torch.randn(length, kv_heads, head_dim, generator=gen)
        v = torch.randn(length, kv_heads, head_dim, generator=gen)
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        # The cached prefix is already in the pool; the new tokens go through forward().
        cached = torch.tensor(seq_slots[:c], dtype=torch.int64, device=device)
        write_kv(k[:c].to(device, dtype), v[:c].to(device, dtype), k_cache, v_cache, cached)
        qs.append(q)
        ks.append(k[c:])
        vs.append(v[c:])
        slots += seq_slots[c:]
        k_ref, v_ref = k.to(dtype), v.to(dtype)
        if pool_dtype is not None:
            k_ref = to_pool(k_ref, pool_dtype).to(dtype)
            v_ref = to_pool(v_ref, pool_dtype).to(dtype)
        refs.append(dense_reference(q.to(dtype).double(), k_ref, v_ref, c))
    layout = BatchLayout(
        query_lens=[n for _, n in shapes],
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decodes=sum(1 for _, n in shapes if n == 1),
        block_size=block_size,
        dtype=dtype,
    )
    meta = backend.build_metadata(layout, device)
    out = backend.forward(
        torch.cat(qs).to(device, dtype),
        torch.cat(ks).to(device, dtype),
        torch.cat(vs).to(device, dtype),
        k_cache,
        v_cache,
        meta,
    )
    return out.double().cpu(), torch.cat(refs)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_torch_backend_matches_dense_attention(block_size: int) -> None:
    """Decodes in length groups and chunks with or without a cached prefix, GQA, fp32."""
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    out, ref = run_backend(backend, block_size, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_torch_backend_reads_an_fp8_pool() -> None:
    """An e4m3 pool: rows rounded as written, widened as read. Chunks with no cached prefix
    attend their own fresh keys, so only they may stray from the rounded reference, by
    e4m3's rounding (3 mantissa bits)."""
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    cpu = torch.device("cpu")
    out, ref = run_backend(backend, 16, cpu, torch.float32, pool_dtype=FP8_KV)
    _, exact = run_backend(backend, 16, cpu, torch.float32)
    num_decodes = sum(1 for _, n in SHAPES if n == 1)
    torch.testing.assert_close(out[:num_decodes], ref[:num_decodes], atol=1e-5, rtol=0)
    torch.testing.assert_close(out, ref, atol=0.15, rtol=0)
    assert not torch.allclose(out[:num_decodes], exact[:num_decodes], atol=1e-3, rtol=0)


# (heads, KV heads, head size): decode's generic walk and prefill at head size 16 (the
# tiny test models'), decode's compiled cases (SmolLM2's 9/3/64; one KV head per query
# head at 128), prefill at a size that is no power of two (Phi-3's 96), and a size prefill
# is not compiled for (24), whose chunks go through torch.
CPU_SHAPES = [(HEADS, KV_HEADS, HEAD_DIM), (9, 3, 64), (4, 4, 128), (6, 2, 96), (4, 2, 24)]
# Decodes longer than the kernel's 32-token tile, at and around block edges.
LONG_DECODES = [(0, 1), (31, 1), (32, 1), (63, 1), (200, 1), (517, 1), (20, 7)]


@pytest.mark.parametrize("dims", CPU_SHAPES)
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_matches_dense_attention(
    dims: tuple[int, int, int], block_size: int, dtype: torch.dtype
) -> None:
    """The C++ decode kernel (and the torch chunks beside it) against the float64 reference:
    the reference sees the same rounded inputs, so bf16 differs only by the output's
    rounding and float32 accumulation."""
    if cpu_kernels.load() is not None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.load()}")
    backend = CpuAttentionBackend(*dims)
    for shapes in (SHAPES, LONG_DECODES):
        out, ref = run_backend(backend, block_size, torch.device("cpu"), dtype, shapes)
        atol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, ref, atol=atol, rtol=0 if atol == 1e-5 else 1e-2)


@pytest.mark.parametrize("dims", CPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_reads_an_fp8_pool(dims: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The C++ kernels over an e4m3 pool, held to the reference over rounded K/V: decodes
    and prefill chunks read every key from the pool (written first). Chunks of a head size
    prefill is not compiled for go through torch, which attends an uncached chunk's fresh
    keys: there only the decodes are held to it."""
    if cpu_kernels.load() is not None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.load()}")
    backend = CpuAttentionBackend(*dims)
    atol, rtol = (1e-5, 0.0) if dtype == torch.float32 else (2e-2, 1e-2)
    for shapes in (SHAPES, LONG_DECODES):
        out, ref = run_backend(backend, 16, torch.device("cpu"), dtype, shapes, pool_dtype=FP8_KV)
        rows = out.shape[0] if dims[2] != 24 else sum(1 for _, n in shapes if n == 1)
        torch.testing.assert_close(out[:rows], ref[:rows], atol=atol, rtol=rtol)


def test_cpu_kernel_refuses_bad_arguments() -> None:
    """Wrong dtypes, lengths past the block table or inconsistent chunk offsets are errors,
    never reads out of bounds: decode and prefill kernels alike."""
    if cpu_kernels.load() is not None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.load()}")
    op = torch.ops.batchinfer_cpu.paged_decode_attention
    cache = torch.zeros(4, 16, 2, 16)
    q, out = torch.zeros(1, 4, 16), torch.zeros(1, 64)
    table, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([33], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        op(out, q, cache, cache, table, lens, 0.25)
    with pytest.raises(RuntimeError, match="int32"):
        op(out, q, cache, cache, table.long(), lens.clamp(max=32), 0.25)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(out, q.bfloat16(), cache, cache, table, lens.clamp(max=32), 0.25)

    prefill = torch.ops.batchinfer_cpu.paged_prefill_attention
    cache, q, out = torch.zeros(4, 16, 2, 64), torch.zeros(3, 4, 64), torch.zeros(3, 256)
    starts = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        prefill(out, q, cache, cache, table, starts, lens, 0.125)
    with pytest.raises(RuntimeError, match="has 3 queries and seq_len 2"):
        prefill(out, q, cache, cache, table, starts, torch.tensor([2], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="query_starts must run from 0"):
        prefill(out, q, cache, cache, table, torch.tensor([0, 2], dtype=torch.int32),
                lens.clamp(max=32), 0.125)
    with pytest.raises(RuntimeError, match="head sizes 16, 32, 64, 80, 96, 128 and 256"):
        prefill(torch.zeros(3, 96), torch.zeros(3, 4, 24), torch.zeros(4, 16, 2, 24),
                torch.zeros(4, 16, 2, 24), table, starts, lens.clamp(max=32), 0.25)
    wide = torch.zeros(4, 16, 1, 64)  # 64 query heads on one KV head: over a tile's rows
    with pytest.raises(RuntimeError, match="up to 48 query heads per KV head"):
        prefill(torch.zeros(3, 64 * 64), torch.zeros(3, 64, 64), wide, wide, table, starts,
                lens.clamp(max=32), 0.125)
    # ... so the backend gives such a model's chunks to the torch path, as it does those of
    # head sizes the kernel is not compiled for.
    assert CpuAttentionBackend(64, 1, 64).pool_workspace_ratio(2) > 0
    assert CpuAttentionBackend(4, 2, 24).pool_workspace_ratio(2) > 0
    assert CpuAttentionBackend(48, 1, 64).pool_workspace_ratio(2) == 0
    assert CpuAttentionBackend(4, 2, 16).pool_workspace_ratio(2) == 0


def test_write_kv_fills_exactly_the_given_slots() -> None:
    """Rows land in their slots; every other slot keeps its value."""
    k_cache = torch.zeros(4, 2, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, KV_HEADS, HEAD_DIM)
    v = torch.randn(3, KV_HEADS, HEAD_DIM)
    write_kv(k, v, k_cache, v_cache, torch.tensor([7, 0, 3]))
    flat_k, flat_v = k_cache.view(8, KV_HEADS, HEAD_DIM), v_cache.view(8, KV_HEADS, HEAD_DIM)
    assert torch.equal(flat_k[[7, 0, 3]], k) and torch.equal(flat_v[[7, 0, 3]], v)
    assert flat_k[[1, 2, 4, 5, 6]].abs().sum() == 0


def test_decode_groups_bound_padding() -> None:
    """Decodes split into groups whose longest needs at most 1.05x the shortest's blocks."""
    backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    seq_lens = [16, 20, 24, 32, 33, 100, 160, 161, 170, 176]
    layout = BatchLayout(
        query_lens=[1] * len(seq_lens),
        seq_lens=seq_lens,
        block_tables=[list(range(-(-n // 16))) for n in seq_lens],
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
        num_decodes=len(seq_lens),
        block_size=16,
    )
    meta = backend.build_metadata(layout, torch.device("cpu"))
    groups = [(g.start, g.end, g.num_blocks) for g in meta.decode_groups]
    assert meta.gather_block_ids.numel() == sum((e - s) * nb for s, e, nb in groups)
    # blocks per sequence: 1 | 2 2 2 | 3 | 7 | 10 | 11 11 11
    assert groups == [(0, 1, 1), (1, 4, 2), (4, 5, 3), (5, 6, 7), (6, 7, 10), (7, 10, 11)]


def test_backends_check_block_size() -> None:
    """flash-attn pages only in multiples of 256; the torch path takes any size."""
    TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM).check_block_size(1)
    flash = FlashAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    flash.check_block_size(512)
    with pytest.raises(ValueError, match="block_size"):
        flash.check_block_size(16)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        TorchAttentionBackend(6, 4, HEAD_DIM)


def test_flash_backend_refused_without_cuda(tmp_path: Path) -> None:
    """Asking for flash attention where it cannot run names the option."""
    if torch.cuda.is_available() and HAS_FLASH_ATTN:
        pytest.skip("flash attention is available here")
    save_llama(tmp_path)
    with pytest.raises(ValueError, match="attention_backend"):
        ModelRunner(EngineConfig(model=str(tmp_path), attention_backend="flash"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["torch", "triton", "flash"])
def test_cuda_backends_match_dense_attention(backend_name: str) -> None:
    """Every backend on CUDA in bf16, within bf16 rounding of the float64 reference."""
    if backend_name == "flash" and not HAS_FLASH_ATTN:
        pytest.skip("flash-attn is not installed")
    classes: dict[str, type[AttentionBackend]] = {
        "torch": TorchAttentionBackend,
        "triton": TritonAttentionBackend,
        "flash": FlashAttentionBackend,
    }
    backend = classes[backend_name](HEADS, KV_HEADS, HEAD_DIM)
    block_size = backend.default_block_size
    out, ref = run_backend(backend, block_size, torch.device("cuda"), torch.bfloat16)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_cuda_backends_read_an_fp8_pool(backend_name: str) -> None:
    """An e4m3 pool on CUDA (sm89+): decode rows within bf16 rounding of the reference over
    rounded K/V; chunks read fresh keys too, so within e4m3's rounding."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 conversions need compute capability 8.9")
    backend_class = TorchAttentionBackend if backend_name == "torch" else TritonAttentionBackend
    backend = backend_class(HEADS, KV_HEADS, HEAD_DIM)
    out, ref = run_backend(backend, 16, torch.device("cuda"), torch.bfloat16, pool_dtype=FP8_KV)
    num_decodes = sum(1 for _, n in SHAPES if n == 1)
    torch.testing.assert_close(out[:num_decodes], ref[:num_decodes], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref, atol=0.15, rtol=0)


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(tmp_path: Path) -> None:
    """Decode logits replayed from a CUDA graph (Triton or flash-attn) equal eager ones."""
    save_llama(tmp_path, head_dim=64, num_attention_heads=2, num_key_value_heads=1, hidden_size=128)
    runners = [
        ModelRunner(
            EngineConfig(model=str(tmp_path), dtype="bfloat16", enforce_eager=eager, max_num_seqs=8)
        )
        for eager in (False, True)
    ]
    assert runners[0].graphs is not None and runners[1].graphs is None
    results = []
    for runner in runners:
        seqs = [make_seq([3 + i] * (5 + 40 * i), f"s{i}") for i in range(3)]
        place(seqs, [s.num_tokens for s in seqs], runner.block_size)
        runner.compute_logits(seqs, [s.num_tokens - 1 for s in seqs])
        for s in seqs:
            s.num_computed_tokens = s.num_tokens - 1
        results.append(runner.compute_logits(seqs, [1, 1, 1])[1].cpu())
    torch.testing.assert_close(results[0], results[1], atol=1e-2, rtol=0)


def _tiny_config() -> LlamaConfig:
    options: dict[str, Any] = dict(TINY)
    return LlamaConfig(**options)


def test_cpu_gets_the_cpu_kernel_else_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on the CPU is the C++ kernel when it builds, else the torch path; Triton there
    only under its interpreter."""
    cpu = torch.device("cpu")
    expected = "cpu" if cpu_kernels.load() is None else "torch"
    assert pick_backend("auto", cpu, torch.float32, _tiny_config()).name == expected
    assert pick_backend("torch", cpu, torch.float32, _tiny_config()).name == "torch"
    with pytest.raises(ValueError, match="attention_backend 'triton'"):
        pick_backend("triton", cpu, torch.float32, _tiny_config())
    monkeypatch.setattr(cpu_kernels, "load", lambda: "no compiler")
    assert pick_backend("auto", cpu, torch.float32, _tiny_config()).name == "torch"
    with pytest.raises(ValueError, match="'cpu' cannot run here: no compiler"):
        pick_backend("cpu", cpu, torch.float32, _tiny_config())


def test_cuda_prefers_flash_on_sm80_then_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn where installed on sm80+ in half precision, Triton otherwise."""
    cuda = torch.device("cuda")
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(placement, "HAS_TRITON", True)
    monkeypatch.setattr(placement, "HAS_FLASH_ATTN", True)
    assert pick_backend("auto", cuda, torch.bfloat16, _tiny_config()).name == "flash"
    assert pick_backend("auto", cuda, torch.float32, _tiny_config()).name == "triton"
    capability[0] = (7, 5)  # T4: flash-attn 2 does not run there
    assert pick_backend("auto", cuda, torch.float16, _tiny_config()).name == "triton"
    with pytest.raises(ValueError, match="compute capability 8.0"):
        pick_backend("flash", cuda, torch.float16, _tiny_config())
    monkeypatch.setattr(placement, "HAS_FLASH_ATTN", False)
    assert pick_backend("auto", cuda, torch.bfloat16, _tiny_config()).name == "triton"


def test_cuda_without_a_fast_path_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Neither flash-attn nor Triton: the torch path, with a WARNING saying what to install."""
    monkeypatch.setattr(placement, "HAS_TRITON", False)
    monkeypatch.setattr(placement, "HAS_FLASH_ATTN", False)
    with caplog.at_level(logging.WARNING, logger=placement.__name__):
        backend = pick_backend("auto", torch.device("cuda"), torch.bfloat16, _tiny_config())
    assert backend.name == "torch"
    assert any(r.levelno == logging.WARNING and "triton" in r.message for r in caplog.records)


def test_triton_block_size_is_a_kernel_tile() -> None:
    """A power of two of at least 16 tokens."""
    backend = TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    backend.check_block_size(16)
    backend.check_block_size(64)
    for bad in (8, 24):
        with pytest.raises(ValueError, match="power of two"):
            backend.check_block_size(bad)


@pytest.mark.parametrize(("name", "current"), [("cuda:1", 0), ("cuda", 2), ("auto", 0)])
def test_the_cuda_device_becomes_current_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, current: int
) -> None:
    """The named CUDA device, else the current one, is made current before weights load or
    graphs capture on a stream; set_device gets an index, as torch requires."""
    save_llama(tmp_path)
    calls: list[torch.device] = []

    class Stop(Exception):
        pass

    def set_device(device: torch.device) -> None:
        _get_device_index(device)  # torch's own check: "cuda" without an index is refused
        calls.append(torch.device(device))
        raise Stop  # the rest needs a real GPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(Stop):
        ModelRunner(EngineConfig(model=str(tmp_path), device=name))
    assert calls == [torch.device("cuda", 1 if name == "cuda:1" else current)]
