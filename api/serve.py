"""Serving the API app on its port: one process, or several sharing the port.

One Python process serves HTTP at about one core at most (one interpreter, one event
loop), so `batchinfer up --api-processes N` runs N of them on one port. Each binds with
SO_REUSEPORT and the kernel spreads new connections among the listening sockets; a
process that stops listening (shutting down, or dead) simply stops receiving them.
"""

from __future__ import annotations

import socket

import uvicorn
from fastapi import FastAPI

from api.http_limits import bounded_http_config
from core.settings import Settings


def listening_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to host:port and listening; shared with other processes that
    bind the same way when reuse_port is set."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def api_server(app: FastAPI, settings: Settings) -> tuple[uvicorn.Server, socket.socket]:
    """A uvicorn server for the app and the socket to run it on (`server.run([sock])`)."""
    sock = listening_socket(settings.api_host, settings.api_port,
                            reuse_port=settings.api_reuse_port)
    config = uvicorn.Config(app, log_level=settings.log_level.lower(), lifespan="on",
                            access_log=settings.api_access_log,
                            **bounded_http_config(settings.api_max_head_bytes,
                                                settings.api_head_timeout_s))
    return uvicorn.Server(config), sock


def serve(settings: Settings) -> None:
    """Serve the API on settings' host and port until interrupted (`batchinfer api`)."""
    from api.app import create_app

    server, sock = api_server(create_app(settings, serving=True), settings)
    server.run(sockets=[sock])
