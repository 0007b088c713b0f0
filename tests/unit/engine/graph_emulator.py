"""A CPU stand-in for CUDA-graph capture and replay, strict about what capture forbids.

`install(monkeypatch)` replaces `torch.cuda.CUDAGraph`, `torch.cuda.graph` and
`torch.cuda.synchronize`. Inside a capture every aten op (and every `batchinfer::` custom
op) is executed once and recorded with the very tensors it read and wrote; `replay()` runs
the recorded ops again in order, writing each result into the tensor the capture produced,
as a real graph replays kernels over fixed addresses. So a replay sees new values only
through the buffers the caller updates in place, exactly like CUDA.

Capture fails, as a real one would (or worse, would silently bake values in), on:
- a host sync: `.item()`, `.tolist()`, `bool(tensor)`, `int(tensor)`, `torch.equal`;
- host data turned into a tensor (`torch.tensor(...)`: `lift_fresh`), pinned memory, or a
  copy between devices.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
# Under inference_mode `item` reaches the mode whole, not as _local_scalar_dense.
_HOST_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
}
_HOST_DATA_OPS = {aten.lift_fresh.default, aten.lift_fresh_copy.default, aten._pin_memory.default}


class CaptureError(AssertionError):
    """Something inside a capture that a CUDA graph cannot hold."""


@dataclass(slots=True)
class _Op:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl: also defined for fake tensors


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: EmulatedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _HOST_SYNC_OPS:
            raise CaptureError(f"{func} reads a device value on the host inside capture")
        if func in _HOST_DATA_OPS:
            raise CaptureError(f"{func}: host data or pinned memory inside capture")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors if t.dim() > 0}
        if func in (aten._to_copy.default, aten.copy_.default) and len(devices) > 1:
            raise CaptureError(f"{func} copies between devices {devices} inside capture")
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.graph.ops.append(_Op(func, args, kwargs, outputs))
        return out


class EmulatedGraph:
    """Records ops during capture; replay() re-runs them into the captured outputs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.ops: list[_Op] = []
        self.num_replays = 0

    def pool(self) -> object:
        """Graphs share memory pools on CUDA; here there is nothing to share."""
        return object()

    def replay(self) -> None:
        """Run every recorded op again over the same tensors."""
        for op in self.ops:
            result = op.func(*op.args, **op.kwargs)
            inputs = {
                _storage(t)
                for t in tree_flatten((op.args, op.kwargs))[0]
                if isinstance(t, torch.Tensor)
            }
            fresh = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            for captured, new in zip(op.outputs, fresh, strict=True):
                # In-place ops and views already wrote (or show) their inputs' memory.
                if _storage(captured) not in inputs:
                    captured.copy_(new)
        self.num_replays += 1


def _forbidden(name: str) -> Any:
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise CaptureError(f"Tensor.{name}() syncs with the host inside capture")

    return method


@contextmanager
def _capture(graph: EmulatedGraph, pool: object = None, **kwargs: Any) -> Iterator[None]:
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "numpy", "cpu")}
    for name in saved:
        setattr(torch.Tensor, name, _forbidden(name))
    try:
        with _Recorder(graph):
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch.cuda's graph API the emulator for the rest of the test."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", EmulatedGraph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
