"""`python -m workers.inference`: run one inference worker with settings from the environment."""

from __future__ import annotations

import logging
import os
import sys
import traceback

from core.settings import get_settings
from workers.inference.runner import run_worker


def main() -> None:
    """Configure logging from settings and run one worker until SIGTERM/SIGINT."""
    settings = get_settings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # kafka-python logs every connection and rebalance step at INFO.
    logging.getLogger("kafka").setLevel(logging.WARNING)
    run_worker(settings)


def _leave(code: int) -> None:
    """Exit without the interpreter's teardown, which would print ~27 lines of "nanobind:
    leaked ..." about Triton's extension objects; run_worker has closed every client,
    thread and file by then, and what is logged is flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # the traceback says why; the supervisor restarts the worker
        traceback.print_exc()
        _leave(1)
    _leave(0)
