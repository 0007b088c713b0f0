"""`ensure_topics` ends by its deadline even against a broker that accepts connections and
never answers (kafka-python's own waits are 30 s each: an API's first submission once
waited a minute on them)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from core.kafka import ensure_topics
from core.settings import Settings


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """host:port of a listener that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_silent_broker_is_given_up_on_by_the_deadline(silent_broker: str) -> None:
    settings = Settings(kafka_bootstrap_servers=silent_broker)
    began = time.monotonic()
    with pytest.raises(ConnectionError, match="did not answer"):
        ensure_topics(settings, timeout_s=2.0)
    assert time.monotonic() - began < 10.0
