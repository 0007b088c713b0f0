"""Suite-wide markers: `integration` for tests/integration, `gpu` tests skip without CUDA;
the order files run in."""

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


def _is_integration(item: pytest.Item) -> bool:
    return _INTEGRATION_DIR in Path(str(item.fspath)).parents


def _runs_long(item: pytest.Item) -> bool:
    """Its module raises the suite's timeout: it runs `batchinfer up` or a real model."""
    module_marks = getattr(getattr(item, "module", None), "pytestmark", [])
    if not isinstance(module_marks, list):
        module_marks = [module_marks]
    return any(mark.name == "timeout" for mark in module_marks)


def _longest_files_first(items: list[pytest.Item]) -> None:
    """Files that start whole stacks first, other integration files next, unit files last.

    The suite runs with `--dist loadfile --no-loadscope-reorder`: each file goes whole to
    the next free xdist worker in this order. Handed out by number of tests (xdist's
    default), the few-test files that each start `up` or a worker came last, and one
    worker ran them alone while the other had nothing left; with many short unit files
    last, both finish together.
    """
    rank: dict[str, int] = {}
    for item in items:
        file_rank = 0 if _runs_long(item) else 1 if _is_integration(item) else 2
        path = str(item.fspath)
        rank[path] = min(rank.get(path, file_rank), file_rank)
    items.sort(key=lambda item: rank[str(item.fspath)])  # stable: files stay whole


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests under tests/integration; skip `gpu` tests when CUDA is absent; order files
    so the longest run first."""
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    has_cuda: bool | None = None
    for item in items:
        if _is_integration(item):
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("gpu"):
            if has_cuda is None:
                has_cuda = _has_cuda()
            if not has_cuda:
                item.add_marker(skip_gpu)
    _longest_files_first(items)
