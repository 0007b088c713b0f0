"""CPU seconds of each role of a `batchinfer up` tree (API, worker, broker, Redis,
callbacks), from snapshots of its processes: where a benchmark's CPU went."""

from __future__ import annotations

import psutil

from tests.utils.up_process import UpProcess

# Which role a process of the `batchinfer up` tree plays, by a piece of its command line.
ROLES = {"workers.inference": "worker", "-m cli": "api+scheduler", "tansu": "broker",
         "redis": "redis", "workers.callbacks": "callbacks", "-m api": "more api processes"}


def cpu_seconds_by_pid(up: UpProcess) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of every process of the `up` tree, with its role."""
    found: dict[int, tuple[str, float]] = {}
    for proc in [psutil.Process(up.process.pid), *up.descendants()]:
        try:
            times, command = proc.cpu_times(), " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        role = next((r for key, r in ROLES.items() if key in command), proc.name())
        found[proc.pid] = (role, times.user + times.system)
    return found


def cpu_seconds_by_role(before: dict[int, tuple[str, float]],
                        after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots."""
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        spent[role] = spent.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return spent
