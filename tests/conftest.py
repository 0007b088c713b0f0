"""Suite-wide markers: `integration` for tests/integration, `gpu` tests skip without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

_INTEGRATION_DIR = Path(__file__).parent / "integration"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests under tests/integration; skip `gpu` tests when CUDA is absent."""
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    has_cuda: bool | None = None
    for item in items:
        if _INTEGRATION_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("gpu"):
            if has_cuda is None:
                has_cuda = _has_cuda()
            if not has_cuda:
                item.add_marker(skip_gpu)
