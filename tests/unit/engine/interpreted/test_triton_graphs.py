"""The Triton backend's decode path: captured and replayed (emulated), and compiled."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine import graph_emulator
from tests.unit.engine.graph_checks import DecodeCase
from workers.engine.triton_attention import TritonAttentionBackend


def test_triton_decode_graph_replays_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replays equal the eager forward over the same buffers exactly, and the unpadded
    eager step, across batch sizes and block-table widths."""
    graph_emulator.install(monkeypatch)
    case = DecodeCase(TritonAttentionBackend, torch.float32, 16, max_batch_size=4)
    case.graphs.capture()
    for round_, (batch_size, width) in enumerate([(1, 1), (3, 4), (4, 2)]):
        batch = case.decode_batch(batch_size, width, seed=round_)
        replayed = case.replay(batch)
        assert replayed.shape[0] == batch_size
        assert torch.equal(replayed, case.eager_on_graph_buffers(batch_size))
        torch.testing.assert_close(replayed, case.eager_step(batch), atol=1e-5, rtol=1e-5)


def test_triton_decode_forward_compiles_without_graph_breaks() -> None:
    """torch.compile(fullgraph=True) traces the decode forward whole: no host syncs, no
    data-dependent Python, the kernels as opaque custom ops; it computes what eager does."""
    case = DecodeCase(TritonAttentionBackend, torch.float32, 16, max_batch_size=4)
    batch = case.decode_batch(4, 3, seed=0)
    g = case.graphs
    for buffer, values in [
        (g.input_ids, batch.input_ids),
        (g.positions, batch.positions),
        (g.slot_mapping, batch.slot_mapping),
        (g.seq_lens, batch.seq_lens),
    ]:
        buffer[:4] = torch.tensor(values, dtype=buffer.dtype)
    for i, table in enumerate(batch.block_tables):
        g.block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    meta = case.backend.decode_metadata(
        g.slot_mapping[:4], g.seq_lens[:4], g.block_tables[:4], g.cu_seqlens_q[:5]
    )
    torch._dynamo.reset()
    compiled = torch.compile(case.model, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = compiled(g.input_ids[:4], g.positions[:4], case.kv_cache, meta)
        ref = case.model(g.input_ids[:4], g.positions[:4], case.kv_cache, meta)
    assert torch.equal(out, ref)
