"""CpuThreadGovernor: threads follow the cores other processes leave free."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from workers.engine.cpu_threads import CpuThreadGovernor


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _governor(samples: list[tuple[float, float, float]]) -> CpuThreadGovernor:
    """A governor fed (time, machine busy seconds, own CPU seconds) samples in order."""
    feed = iter(samples)
    governor = CpuThreadGovernor.__new__(CpuThreadGovernor)
    governor.max_threads = governor.num_threads = torch.get_num_threads()
    governor.interval = 0.0
    governor._sample = lambda: next(feed)  # type: ignore[method-assign]
    governor._last = governor._sample()
    return governor


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back(two_threads: object) -> None:
    # Each second: the machine busy 2 s; we used 1.3 s, so others 0.7 core -> 1 thread.
    governor = _governor([(0, 0, 0), (1, 2.0, 1.3), (2, 4.0, 2.3), (3, 5.9, 4.2)])
    governor.adjust()
    assert (governor.num_threads, torch.get_num_threads()) == (1, 1)
    governor.adjust()  # the neighbour holds a whole core: still 1
    assert governor.num_threads == 1
    governor.adjust()  # others used 0.0 of the last second: both cores are free again
    assert (governor.num_threads, torch.get_num_threads()) == (2, 2)


def test_never_above_the_starting_count(two_threads: object) -> None:
    torch.set_num_threads(1)
    governor = _governor([(0, 0, 0), (1, 0.1, 0.1)])
    governor.adjust()
    assert governor.num_threads == 1 and not governor.is_enabled


def test_reads_this_machine() -> None:
    governor = CpuThreadGovernor(interval=0.0)
    governor.adjust()
    assert 1 <= governor.num_threads <= governor.max_threads
    torch.set_num_threads(governor.max_threads)
