"""How the API is served: uvicorn's access log follows its setting (off by default)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi import FastAPI

from api.serve import api_server
from core.settings import Settings
from scheduler.embedded_services import free_port


@pytest.mark.parametrize("asked", [None, True])
def test_the_access_log_is_off_unless_asked_for(asked: bool | None) -> None:
    overrides: dict[str, Any] = {} if asked is None else {"api_access_log": asked}
    server, sock = api_server(FastAPI(), Settings(api_host="127.0.0.1", api_port=free_port(),
                                                  **overrides))
    try:
        server.config.configure_logging()
        access = logging.getLogger("uvicorn.access")
        assert server.config.access_log is bool(asked)
        # uvicorn drops the access logger's handlers when the log is off.
        assert bool(access.handlers) is bool(asked)
    finally:
        sock.close()
