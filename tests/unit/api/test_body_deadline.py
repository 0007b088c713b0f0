"""A request body that stops arriving is answered 408 and its connection closed; a body
that is complete is never timed (a stream listens on `receive` for its client's end)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.body_deadline import BodyReadTimeout, with_body_deadline
from tests.unit.api.conftest import ClientFactory
from tests.utils.api import TenantKey


def _stalled_request(client: TestClient, path: str, headers: dict[str, str]
                     ) -> list[dict[str, Any]]:
    """Send 10 of 1,000 declared bytes to the app and nothing more; what the app sent."""
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    raw_headers += [(b"content-type", b"application/json"), (b"content-length", b"1000")]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": raw_headers,
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}
    chunks = [{"type": "http.request", "body": b'{"model": ', "more_body": True}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if chunks:
            return chunks.pop(0)
        await asyncio.sleep(3600)  # the client's stall
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    async def run() -> None:
        await asyncio.wait_for(client.app(scope, receive, send), 30)

    assert client.portal is not None
    client.portal.call(run)
    return sent


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/chat/completions", "/v1/batches"])
def test_a_stalled_body_is_a_408_that_closes_the_connection(
    make_client: ClientFactory, acme: TenantKey, path: str,
) -> None:
    """`/v1/jobs` is read by the hot path, the others by FastAPI: both answer the same."""
    client = make_client(api_body_read_timeout_s=0.2)
    sent = _stalled_request(client, path, acme.headers)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 408
    assert (b"connection", b"close") in [(k.lower(), v) for k, v in start["headers"]]
    body = json.loads(b"".join(m.get("body", b"") for m in sent
                               if m["type"] == "http.response.body"))
    assert "stopped arriving" in body["error"]["message"]


def test_a_complete_body_leaves_receive_untimed() -> None:
    """After the last chunk, a wait for the disconnect is the stream's business."""
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(0.3)
        return {"type": "http.disconnect"}

    async def run() -> None:
        timed = with_body_deadline(receive, 0.05)
        assert (await timed())["type"] == "http.request"
        assert (await timed())["type"] == "http.disconnect"  # 0.3 s: past the deadline

        stalled = with_body_deadline(receive, 0.05)
        with pytest.raises(BodyReadTimeout):
            await stalled()  # no body yet: the deadline holds

    asyncio.run(run())
