"""`python -m api`: serve the API with uvicorn on `api_host:api_port`."""

from __future__ import annotations

import logging

import uvicorn

from api.app import create_app
from core.settings import get_settings


def main() -> None:
    """Run the API until interrupted."""
    settings = get_settings()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings, serving=True), host=settings.api_host, port=settings.api_port,
                log_level=settings.log_level.lower())


if __name__ == "__main__":
    main()
