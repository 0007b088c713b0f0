"""`python -m workers.callbacks`: run the webhook delivery worker with its dispatcher beat."""

from __future__ import annotations

import logging
import sys

from core.settings import get_settings
from workers.callbacks.app import run_callbacks

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


def main() -> int:
    """Run the callbacks role until SIGTERM; the exit status."""
    settings = get_settings()
    # A no-op under `batchinfer callbacks`, which configured logging already.
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    run_callbacks(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
