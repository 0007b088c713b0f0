"""`python -m workers.inference`: run one inference worker with settings from the environment."""

from __future__ import annotations

import logging
import os
import sys

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


if __name__ == "__main__":
    main()
    # Stopped cleanly: every client, thread and file was closed by run_worker. Leaving
    # without the interpreter's teardown spares the ~27 lines of "nanobind: leaked ..."
    # that Triton's extension prints about its objects then; a failure above still exits
    # the ordinary way, with its traceback.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
