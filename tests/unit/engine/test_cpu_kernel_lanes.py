"""The CPU attention kernel at the vector width this CPU does not pick.

The kernel's register blocks follow the target: 16-float vectors with AVX-512, 8 without.
The backend tests run the width of the machine they are on; this builds the other one
(`-DBATCHINFER_LANES`, which the compiler lowers to correct halves or pairs of registers)
in a child process, since the ops' namespace registers once per process, and checks its
prefill and decode against float64 attention.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils.budget import within_budget
from workers.engine import cpu_kernels

REPO = Path(__file__).resolve().parents[3]

CHILD = r"""
import sys
import torch
from torch.utils.cpp_extension import load
from tests.unit.engine.test_attention import dense_reference
from workers.engine import cpu_kernels

lanes, build = sys.argv[1], sys.argv[2]
load(name="batchinfer_lanes_check",
     sources=[str(cpu_kernels.KERNELS / "cpu_paged_attention.cpp")],
     # -O0: the same arithmetic and the same lowering of the vector types to the other
     # width, built in half of -O1's compiler time (16 s of CPU against 33 s).
     extra_cflags=[*(f for f in cpu_kernels.compile_flags() if f != "-O3"), "-O0",
                   f"-DBATCHINFER_LANES={lanes}"],
     extra_ldflags=["-fopenmp"], build_directory=build, is_python_module=False)
ops = torch.ops.batchinfer_cpu
gen = torch.Generator().manual_seed(0)
BS = 16

def pool(lengths, kv_heads, head_dim, dtype):
    '''K/V pools holding sequences of these lengths in shuffled blocks, and their tables.'''
    width = max((n + BS - 1) // BS for n in lengths)
    num_blocks = width * len(lengths)
    order = torch.randperm(num_blocks, generator=gen).int()
    tables = order.reshape(len(lengths), width)
    k = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=gen).to(dtype)
    return k, v, tables

def dense(cache, table, length):
    return cache[table.long()].flatten(0, 1)[:length]

worst = {}
for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
    # (heads, kv heads, head size): SmolLM2's group of 3, MQA groups of 8 and 48 (a whole
    # tile's rows), no grouping; decode also through its generic walk (group 7); prefill at
    # the small, odd-sized and large head sizes it is compiled for (16, 80, 256).
    for heads, kv_heads, head_dim in ((9, 3, 64), (8, 1, 128), (48, 1, 64), (4, 4, 64),
                                      (7, 1, 64), (4, 2, 16), (6, 2, 80), (2, 1, 256)):
        scale = head_dim ** -0.5
        # Prefill chunks: (cached, new) of one step, a whole prompt beside a chunk that
        # continues a cached prefix and a lone query.
        chunks = [(0, 70), (37, 5), (100, 1), (16, 33)]
        lengths = [c + n for c, n in chunks]
        k, v, tables = pool(lengths, kv_heads, head_dim, dtype)
        if heads // kv_heads <= 48:
            q = torch.randn(sum(n for _, n in chunks), heads, head_dim, generator=gen).to(dtype)
            out = torch.empty(q.shape[0], heads * head_dim, dtype=dtype)
            starts = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0)],
                                  dtype=torch.int32)
            ops.paged_prefill_attention(out, q, k, v, tables, starts,
                                        torch.tensor(lengths, dtype=torch.int32), scale)
            for i, (cached, new) in enumerate(chunks):
                rows = slice(int(starts[i]), int(starts[i + 1]))
                ref = dense_reference(q[rows], dense(k, tables[i], cached + new),
                                      dense(v, tables[i], cached + new), cached)
                error = (out[rows].double() - ref).abs().max().item()
                worst[("prefill", dtype, heads, kv_heads)] = error
                assert error < tolerance, (lanes, "prefill", dtype, heads, kv_heads, i, error)
        # Decode: one query per sequence over lengths that end mid-tile and mid-vector.
        lengths = [1, 7, 33, 200, 129]
        k, v, tables = pool(lengths, kv_heads, head_dim, dtype)
        q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
        out = torch.empty(len(lengths), heads * head_dim, dtype=dtype)
        ops.paged_decode_attention(out, q, k, v, tables,
                                   torch.tensor(lengths, dtype=torch.int32), scale)
        for i, length in enumerate(lengths):
            ref = dense_reference(q[i:i + 1], dense(k, tables[i], length),
                                  dense(v, tables[i], length), length - 1)
            error = (out[i:i + 1].double() - ref).abs().max().item()
            worst[("decode", dtype, heads, kv_heads)] = error
            assert error < tolerance, (lanes, "decode", dtype, heads, kv_heads, i, error)
print(len(worst), "cases within tolerance")
"""


# Builds the kernels for the other vector width in a child: its own limit ends first.
@pytest.mark.timeout(1200)
@pytest.mark.skipif(cpu_kernels.load() is not None, reason="no C++ build here")
def test_the_other_vector_width_matches_dense_attention(tmp_path: Path) -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    lanes = 8 if " avx512f" in flags else 16

    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(lanes), str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=within_budget(900),
    )

    assert child.returncode == 0, child.stderr[-4000:]
    assert "32 cases within tolerance" in child.stdout  # 8 shapes, 2 dtypes, 2 kernels
