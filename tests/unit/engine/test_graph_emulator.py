"""The capture emulator itself: it refuses what CUDA graphs cannot hold, and replays
recorded work over whatever the input buffers hold at replay time."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine import graph_emulator
from tests.unit.engine.graph_emulator import CaptureError


@pytest.fixture(autouse=True)
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    graph_emulator.install(monkeypatch)


def capture(fn) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def test_replay_recomputes_from_the_buffers() -> None:
    """Outputs follow new buffer contents, through views and in-place ops."""
    x = torch.arange(6.0)
    out = torch.zeros(3)

    def step() -> None:
        out.copy_((x.view(2, 3) * 2).sum(0))

    capture(step).replay()
    assert torch.equal(out, torch.tensor([6.0, 10.0, 14.0]))
    x.copy_(torch.ones(6))
    graph = capture(step)
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(out, torch.tensor([8.0, 8.0, 8.0]))


@pytest.mark.parametrize(
    "bad",
    [
        lambda x: x.sum().item(),
        lambda x: int(x.max()),
        lambda x: x.tolist(),
        lambda x: bool(x.sum() > 0),
        lambda x: x + torch.tensor([1.0, 2.0, 3.0]),
        lambda x: x.cpu(),
    ],
    ids=["item", "int", "tolist", "bool", "host-data", "cpu"],
)
@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_capture_refuses_host_syncs_and_host_data(bad, inference: bool) -> None:  # type: ignore[no-untyped-def]
    """Reading a device value on the host, or baking host data in, fails at capture, also
    under inference_mode (where DecodeGraphs captures)."""
    x = torch.ones(3)
    with torch.inference_mode(inference), pytest.raises(CaptureError):
        capture(lambda: bad(x))


def test_a_value_baked_in_at_capture_goes_stale() -> None:
    """What a graph cannot see: a Python number read before capture stays as captured."""
    x = torch.ones(3)
    out = torch.zeros(3)
    offset = 1.0
    graph = capture(lambda: out.copy_(x + offset))
    offset = 5.0
    graph.replay()
    assert torch.equal(out, torch.full((3,), 2.0))  # not 6: replays never rerun Python
