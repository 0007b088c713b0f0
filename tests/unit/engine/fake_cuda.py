"""FakeTensorMode with a fake `cuda:0` device on a CPU-only torch build.

Under it, tensors carry shapes, dtypes and devices but no data, and torch's own device
propagation raises `FakeTensorDeviceMismatchError` when a CPU tensor meets a CUDA one in
an op: the check these tests are after. Three gaps of the CPU build are bridged here:
- Python indexing and `.to()` enter a CUDA device guard, which a CPU build lacks: the
  CPU's no-op guard is lent for the duration (restored afterwards);
- pinned memory needs the CUDA driver: `pin_memory()` returns its tensor unchanged;
- CUDA generators need the CUDA library: `torch.Generator(device="cuda...")` gives a CPU
  one (fake random ops ignore the generator's device);
- host tensors made by torch.frombuffer are real under the mode: they are let in, as fake
  CPU tensors.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

CUDA = torch.device("cuda:0")
_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"  # c10::impl::device_guard_impl_registry


def _guard_slots() -> Any:
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    base = ctypes.addressof(ctypes.c_void_p.in_dll(lib, _REGISTRY))
    return (ctypes.c_void_p * 2).from_address(base), 0, 1  # DeviceType::CPU, DeviceType::CUDA


class _CpuGenerator:
    """torch.Generator that builds a CPU generator when asked for a CUDA one."""

    def __new__(cls, device: Any = "cpu") -> torch.Generator:  # type: ignore[misc]
        return _REAL_GENERATOR()


_REAL_GENERATOR = torch.Generator


@contextmanager
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTensorMode]:
    """Enter a FakeTensorMode in which `cuda:0` tensors can be made and used."""
    if torch.cuda.is_available():
        pytest.skip("a real CUDA device is present; the GPU tests cover it")
    slots, cpu, cuda = _guard_slots()
    saved = slots[cuda]
    if not saved:
        slots[cuda] = slots[cpu]
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(torch, "Generator", _CpuGenerator)
    try:
        # Real inputs are allowed: host tensors built with torch.frombuffer (which the mode
        # does not intercept) are real, and become fake CPU tensors on use, so a CPU tensor
        # meeting a CUDA one still raises.
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        slots[cuda] = saved
