"""A liveness file: stamped while a process works, its age read by whoever watches it.

The inference worker touches one with every heartbeat (workers/inference/liveness); the
local supervisor (scheduler/supervisor) and the Kubernetes probes judge the worker by its
age. A file, not a port: it needs no server in the worker, and a frozen process (SIGSTOP,
a hung loop) cannot answer for itself anyway.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def touch(path: Path) -> None:
    """Stamp the file now, creating it (and its folder) if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    os.utime(path)


def age_s(path: Path, now: float | None = None) -> float | None:
    """Seconds since the file was last stamped; None when there is none yet."""
    try:
        stamped_at = path.stat().st_mtime
    except FileNotFoundError:
        return None
    return max(0.0, (time.time() if now is None else now) - stamped_at)
