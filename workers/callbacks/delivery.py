"""One webhook attempt: a signed POST to a checked address, classified.

Redirects are not followed, the whole attempt (DNS, connect, send, response) runs under
one deadline besides httpx's connect and read timeouts, and at most a few KiB of the
response are read, so neither a slow nor a chatty receiver can hold a worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from core.settings import Settings
from core.webhook_urls import Allowlist
from workers.callbacks.retry_policy import Verdict, classify_status, parse_retry_after
from workers.callbacks.ssrf import (
    PinnedTarget,
    RefusedDestination,
    UnresolvedHost,
    pin_callback_url,
)

logger = logging.getLogger(__name__)

USER_AGENT = "batchinfer-webhooks/1"


@dataclass(frozen=True, slots=True)
class AttemptOutput:
    """What one attempt did: the verdict and what is recorded about it."""

    verdict: Verdict
    status_code: int | None
    latency_ms: float
    error: str | None = None
    response_body: str | None = None
    retry_after_s: float | None = None


def attempt_delivery(
    *, url: str, body: bytes, headers: dict[str, str], settings: Settings
) -> AttemptOutput:
    """POST `body` with `headers` to `url` once; never raises for the receiver's faults."""
    return asyncio.run(attempt_delivery_async(url=url, body=body, headers=headers,
                                              settings=settings))


async def attempt_delivery_async(
    *, url: str, body: bytes, headers: dict[str, str], settings: Settings
) -> AttemptOutput:
    """The coroutine behind `attempt_delivery`, for callers already in an event loop."""
    started = time.perf_counter()

    def elapsed_ms() -> float:
        return (time.perf_counter() - started) * 1000.0

    try:
        async with asyncio.timeout(settings.webhook_timeout_s):
            target = await pin_callback_url(url, Allowlist.parse(settings.webhook_allowlist))
            response, text = await _post(target, body=body, headers=headers,
                                         settings=settings)
    except RefusedDestination as e:
        return AttemptOutput(Verdict.FAILED, None, elapsed_ms(), error=f"refused: {e}")
    except UnresolvedHost as e:
        return AttemptOutput(Verdict.RETRY, None, elapsed_ms(), error=str(e))
    except (TimeoutError, httpx.TimeoutException):
        error = f"timed out after {elapsed_ms() / 1000.0:.1f} s"
        return AttemptOutput(Verdict.RETRY, None, elapsed_ms(), error=error)
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return AttemptOutput(Verdict.RETRY, None, elapsed_ms(), error=error)
    return _classify(response, text, elapsed_ms())


async def _post(
    target: PinnedTarget, *, body: bytes, headers: dict[str, str], settings: Settings
) -> tuple[httpx.Response, str]:
    """Send the request to the pinned address; the response and its first bytes, decoded."""
    timeout = httpx.Timeout(settings.webhook_timeout_s, connect=settings.webhook_connect_timeout_s)
    all_headers = {
        **headers,
        "host": target.host_header,
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        # Raw bytes are read and cut; no decompression of whatever the receiver sends.
        "accept-encoding": "identity",
    }
    # trust_env=False: a proxy from the environment would connect elsewhere than the
    # address just checked.
    client = httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False)
    async with client:
        request = client.build_request("POST", target.url, content=body, headers=all_headers,
                                       extensions=target.request_extensions())
        response = await client.send(request, stream=True)
        try:
            head = await _read_at_most(response, settings.webhook_max_response_bytes)
        finally:
            await response.aclose()
    return response, head.decode("utf-8", errors="replace")


async def _read_at_most(response: httpx.Response, max_bytes: int) -> bytes:
    """Up to `max_bytes` of the raw body; the rest is never read."""
    chunks = bytearray()
    if max_bytes == 0:
        return bytes(chunks)
    async for chunk in response.aiter_raw():
        chunks.extend(chunk[: max_bytes - len(chunks)])
        if len(chunks) >= max_bytes:
            break
    return bytes(chunks)


def _classify(response: httpx.Response, text: str, latency_ms: float) -> AttemptOutput:
    """Turn the receiver's answer into a verdict and an error line for the record."""
    code = response.status_code
    verdict = classify_status(code)
    error: str | None = None
    if verdict is not Verdict.SUCCEEDED:
        error = f"HTTP {code} {response.reason_phrase}".rstrip()
    if 300 <= code < 400:
        error = f"{error}: redirect to {response.headers.get('location', '?')!r} not followed"
    elif code == 410:
        error = f"{error}: the receiver is gone, no more retries"
    retry_after = parse_retry_after(response.headers.get("retry-after"))
    if verdict is not Verdict.RETRY:
        retry_after = None
    return AttemptOutput(verdict, code, latency_ms, error=error, response_body=text or None,
                         retry_after_s=retry_after)
