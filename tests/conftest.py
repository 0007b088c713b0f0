"""Suite-wide markers: `integration` for tests/integration, `gpu` tests skip without CUDA;
the order files run in; each test's waits end before its timeout (`tests.utils.budget`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils.budget import begin_test

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


def _timeout_s(item: pytest.Item) -> float | None:
    """The item's pytest-timeout limit (marker, else option, environment or ini)."""
    try:
        from pytest_timeout import _get_item_settings
    except ImportError:  # the plugin is not installed: no limit to keep within
        return None
    timeout = _get_item_settings(item).timeout
    return float(timeout) if timeout else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start the test's clock for `tests.utils.budget.within_budget`."""
    begin_test(_timeout_s(item))
