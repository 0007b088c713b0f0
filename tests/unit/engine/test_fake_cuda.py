"""Device placement on a fake CUDA device: every tensor of a CUDA step lives on the GPU.

Under FakeTensorMode (fake_cuda.py) tensors have no data, and torch raises
(FakeTensorDeviceMismatchError, or an op's own check) when a CPU tensor meets a CUDA
one. Both attention backends, the sampler and decode-graph capture run here as they
would on a GPU.
"""

from __future__ import annotations

from array import array

import pytest
import torch

from tests.unit.engine import graph_emulator
from tests.unit.engine.fake_cuda import CUDA, fake_cuda
from tests.unit.engine.graph_checks import DecodeCase
from tests.unit.engine.test_attention import HEAD_DIM, HEADS, KV_HEADS, SHAPES, run_backend
from workers.engine.attention import BatchLayout, TorchAttentionBackend
from workers.engine.sampler import Sampler
from workers.engine.sampling_params import SamplingParams


def test_torch_backend_stays_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Metadata, masks, gathers and SDPA of a mixed step all on CUDA."""
    with fake_cuda(monkeypatch):
        backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
        run_backend(backend, 16, CUDA, torch.bfloat16, SHAPES)
        meta = backend.build_metadata(_layout(), CUDA)
        masks = [g.mask for g in meta.decode_groups] + [
            c.mask for c in meta.chunks if c.mask is not None
        ]
        assert masks and all(m.device == CUDA for m in masks)


def test_triton_backend_stays_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' argument checks (their fake implementations) see one device."""
    pytest.importorskip("triton")
    from workers.engine.triton_attention import TritonAttentionBackend

    with fake_cuda(monkeypatch):
        run_backend(
            TritonAttentionBackend(HEADS, KV_HEADS, HEAD_DIM), 16, CUDA, torch.float16, SHAPES
        )


def test_a_host_tensor_in_a_cuda_step_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check bites: a slot mapping left on the host breaks the step."""
    with fake_cuda(monkeypatch):
        backend = TorchAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
        layout = _layout()
        layout.slot_mapping = torch.zeros(4, dtype=torch.int64)  # on the CPU
        meta = backend.build_metadata(layout, CUDA)
        q = torch.zeros(4, HEADS, HEAD_DIM, device=CUDA)
        k = torch.zeros(4, KV_HEADS, HEAD_DIM, device=CUDA)
        cache = torch.zeros(8, 16, KV_HEADS, HEAD_DIM, device=CUDA)
        # FakeTensorDeviceMismatchError, or an op's own device check: both RuntimeErrors.
        with pytest.raises(RuntimeError, match="device"):
            backend.forward(q, k, k, cache, cache, meta)


def test_a_real_host_tensor_in_a_cuda_op_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real host tensors are let into the mode (torch.frombuffer's) and still caught."""
    with fake_cuda(monkeypatch):
        pool = torch.zeros(4, 8, device=CUDA)
        rows = torch.frombuffer(array("q", [2, 0]), dtype=torch.int64)
        with pytest.raises(RuntimeError, match="device"):
            pool.index_select(0, rows)
        assert pool.index_select(0, rows.to(CUDA)).device == CUDA


def test_sampler_stays_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy, seeded and unseeded rows, top-k, top-p and logprobs: results on CUDA."""
    with fake_cuda(monkeypatch):
        sampler = Sampler(0, CUDA)
        params = [
            SamplingParams(temperature=0),
            SamplingParams(temperature=0.7, top_k=5, seed=3, logprobs=True),
            SamplingParams(temperature=1.0, top_p=0.8),
            SamplingParams(temperature=1.2, top_k=3, top_p=0.5, seed=9),
        ]
        logits = torch.zeros(len(params), 64, device=CUDA)
        token_ids, logprobs = sampler.sample_on_device(logits, params, [0, 4, 1, 2])
        assert token_ids.device == CUDA and token_ids.shape == (4,)
        assert logprobs is not None and logprobs.device == CUDA


def test_decode_graph_capture_stays_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture and replay of the Triton decode graphs with model and pool on CUDA."""
    pytest.importorskip("triton")
    from workers.engine.triton_attention import TritonAttentionBackend

    graph_emulator.install(monkeypatch)
    with fake_cuda(monkeypatch):
        case = DecodeCase(TritonAttentionBackend, torch.float32, 16, max_batch_size=4, device=CUDA)
        case.graphs.capture()
        hidden = case.replay(case.decode_batch(3, 2, seed=0))
        assert hidden.device == CUDA and hidden.shape[0] == 3


def _layout() -> BatchLayout:
    """Two decodes and a chunk of two over a cached prefix, slots on CUDA."""
    return BatchLayout(
        query_lens=[1, 1, 2],
        seq_lens=[3, 20, 6],
        block_tables=[[0], [1, 2], [3]],
        slot_mapping=torch.tensor([2, 35, 52, 53], device=CUDA),
        num_decodes=2,
        block_size=16,
        dtype=torch.bfloat16,
    )
