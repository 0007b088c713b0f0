"""The engine is built on a thread that ends (`built_on_a_passing_thread`), so the engine
thread's OpenMP team is the process's only one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from workers.inference.engine_loop import built_on_a_passing_thread

# Run in a fresh interpreter: a pytest worker's main thread may already hold a team.
_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    from workers.inference.engine_loop import built_on_a_passing_thread

    def threads():
        return len(os.listdir("/proc/self/task"))

    def build():
        x = torch.ones(1 << 22)
        return float((x * 2).sum())  # big enough for every thread of the team

    def left(before):
        deadline = time.monotonic() + 10
        while threads() > before and time.monotonic() < deadline:
            time.sleep(0.05)  # an ended thread's team leaves as it is freed
        return threads() - before

    torch.set_num_threads(2)
    before = threads()
    assert built_on_a_passing_thread(build) == 2.0 * (1 << 22)
    passing = left(before)
    build()  # the control: the same build on this thread keeps its team's helper
    print(passing, threads() - before)
""")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: no team to leave behind")
def test_a_build_on_a_passing_thread_leaves_no_openmp_team_behind() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=120, check=True)
    passing, on_caller = (int(n) for n in done.stdout.split()[-2:])
    assert on_caller >= 1
    assert passing == 0


def test_the_build_returns_its_value_and_raises_its_error() -> None:
    assert built_on_a_passing_thread(lambda: 42) == 42

    def fails() -> int:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        built_on_a_passing_thread(fails)
