"""`python -m api`: serve the API with uvicorn on `api_host:api_port`."""

from __future__ import annotations

import logging

from api.serve import serve
from core.settings import get_settings


def main() -> None:
    """Run the API until interrupted."""
    settings = get_settings()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(settings)


if __name__ == "__main__":
    main()
