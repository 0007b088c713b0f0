"""A worker's liveness: its poll loop's pulse, and a file whose age says the worker lives.

Responsible for:
- `LoopPulse`: the poll loop stamps it every turn; the heartbeat thread reads how long the
  loop has been silent, and stops beating once that passes the stall timeout, so a worker
  whose loop hangs looks as dead as one that crashed (its jobs are handed back, and its
  supervisor or Kubernetes replaces it) instead of beating on from a healthy thread;
- the liveness file (`core.liveness_file`): touched with every beat the heartbeat thread
  gives (whether the database took the beat or not: a database outage is ridden out, not
  a reason to die), so its age is the time since the worker was last known to work. A
  frozen process (SIGSTOP, a hung loop, a deadlock) lets it age;
- `python -m workers.inference.liveness [--max-age-s N]`: exit 0 while the file is fresh
  (the Kubernetes probes' exec check), 1 with the reason otherwise.

The local supervisor (`scheduler.supervisor`) reads the same file's age and SIGKILLs a
worker whose file is older than the heartbeat timeout.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from core.liveness_file import age_s

if TYPE_CHECKING:
    from core.settings import Settings


class LoopPulse:
    """When the poll loop last went round (monotonic clock); thread-safe to read."""

    def __init__(self) -> None:
        self._at = time.monotonic()

    def beat(self) -> None:
        """The loop went round just now."""
        self._at = time.monotonic()

    def silent_for_s(self) -> float:
        """Seconds since the loop last went round (or since the pulse was made)."""
        return time.monotonic() - self._at


def parser(settings: Settings) -> argparse.ArgumentParser:
    """The check's command line."""
    parser = argparse.ArgumentParser(
        prog="python -m workers.inference.liveness",
        description="Exit 0 while this container's worker is alive (its liveness file is "
                    "fresh), 1 otherwise.")
    parser.add_argument("--max-age-s", type=float, default=settings.worker_heartbeat_timeout_s,
                        help="oldest acceptable stamp (default: the heartbeat timeout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit 0 while the liveness file is fresh, else 1 with the reason on stderr."""
    from core.settings import get_settings

    settings = get_settings()
    args = parser(settings).parse_args(argv)
    path = settings.worker_liveness_file
    if path is None:
        sys.stderr.write("BATCHINFER_WORKER_LIVENESS_FILE is not set\n")
        return 1
    age = age_s(path)
    if age is None:
        sys.stderr.write(f"{path} does not exist: the worker has not started working\n")
        return 1
    if age > args.max_age_s:
        sys.stderr.write(f"{path} is {age:.0f}s old (over {args.max_age_s:.0f}s): the worker "
                         "is stalled\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
