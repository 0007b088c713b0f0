"""The inference worker role: Kafka priority topics → the engine → the database.

`python -m workers.inference` runs one worker; `run_worker(settings)` does the same in
process (see `runner`); `worker` holds the poll loop. `run_worker` is imported lazily so
that the pure parts (offsets, priority, sampling, results) load without torch or Kafka.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.inference.runner import run_worker

__all__ = ["run_worker"]


def __getattr__(name: str) -> Any:
    """Import `run_worker` on first use."""
    if name == "run_worker":
        from workers.inference.runner import run_worker

        return run_worker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
