"""`python -m workers.inference`: run one inference worker with settings from the environment."""

from __future__ import annotations

import logging

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
