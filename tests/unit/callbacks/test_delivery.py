"""One attempt against a loopback receiver: verdicts, redirects, limits and timeouts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from standardwebhooks import Webhook

from core.settings import Settings
from storage.webhook_secrets import generate_secret
from tests.utils.webhook_receiver import Reply, WebhookReceiver, run_receiver
from workers.callbacks.delivery import attempt_delivery
from workers.callbacks.retry_policy import Verdict
from workers.callbacks.signing import signature_headers

BODY = b'{"type":"job.succeeded","timestamp":"2026-01-01T00:00:00Z","data":{"id":"job_1"}}'


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path, webhook_allowlist=["127.0.0.1"], webhook_timeout_s=1.5,
                    webhook_connect_timeout_s=1.0, webhook_claim_s=5,
                    webhook_max_response_bytes=64)


@pytest.fixture
def receiver(request: pytest.FixtureRequest) -> Iterator[WebhookReceiver]:
    replies: list[Reply] = getattr(request, "param", [])
    with run_receiver(WebhookReceiver(replies)) as running:
        yield running


def send(receiver: WebhookReceiver, settings: Settings, secret: str | None = None):
    headers = signature_headers(secrets_in_use=[secret or generate_secret()],
                                webhook_id="msg_1", timestamp=int(time.time()), body=BODY)
    return attempt_delivery(url=receiver.url, body=BODY, headers=headers, settings=settings)


def test_success_is_signed_json(receiver: WebhookReceiver, settings: Settings) -> None:
    secret = generate_secret()
    output = send(receiver, settings, secret)
    assert output.verdict is Verdict.SUCCEEDED and output.status_code == 200
    assert output.error is None and output.latency_ms > 0
    [request] = receiver.requests
    assert request.body == BODY
    assert request.headers["content-type"] == "application/json"
    assert request.headers["host"] == receiver.url.split("/")[2]
    Webhook(secret).verify(request.body, request.headers)


@pytest.mark.parametrize(
    ("receiver", "verdict", "error_part"),
    [
        ([Reply(status=503)], Verdict.RETRY, "HTTP 503"),
        ([Reply(status=408)], Verdict.RETRY, "HTTP 408"),
        ([Reply(status=410)], Verdict.FAILED, "gone"),
        ([Reply(status=400)], Verdict.FAILED, "HTTP 400"),
        ([Reply(status=302, headers={"location": "http://169.254.169.254/"})],
         Verdict.FAILED, "not followed"),
    ],
    indirect=["receiver"],
)
def test_answers_are_classified(
    receiver: WebhookReceiver, settings: Settings, verdict: Verdict, error_part: str
) -> None:
    output = send(receiver, settings)
    assert output.verdict is verdict
    assert output.error is not None and error_part in output.error
    assert len(receiver.requests) == 1  # a redirect is not followed


@pytest.mark.parametrize("receiver", [[Reply(status=429, headers={"retry-after": "7"})]],
                         indirect=True)
def test_retry_after_is_read(receiver: WebhookReceiver, settings: Settings) -> None:
    output = send(receiver, settings)
    assert output.verdict is Verdict.RETRY and output.retry_after_s == 7.0


@pytest.mark.parametrize("receiver", [[Reply(body=b"x" * 100_000)]], indirect=True)
def test_response_body_is_cut(receiver: WebhookReceiver, settings: Settings) -> None:
    output = send(receiver, settings)
    assert output.verdict is Verdict.SUCCEEDED
    assert output.response_body == "x" * settings.webhook_max_response_bytes


@pytest.mark.parametrize("receiver", [[Reply(sleep_s=4.0)]], indirect=True)
def test_slow_receiver_times_out(receiver: WebhookReceiver, settings: Settings) -> None:
    started = time.monotonic()
    output = send(receiver, settings)
    assert time.monotonic() - started < settings.webhook_timeout_s + 1.0
    assert output.verdict is Verdict.RETRY and output.status_code is None
    assert output.error is not None and "timed out" in output.error


def test_connection_refused_is_retried(settings: Settings) -> None:
    with run_receiver(WebhookReceiver()) as receiver:
        url = receiver.url
    closed = WebhookReceiver()
    closed.url = url  # the server is gone: nothing listens there any more
    output = send(closed, settings)
    assert output.verdict is Verdict.RETRY and output.status_code is None


def test_private_address_refused_at_delivery(tmp_path: Path, receiver: WebhookReceiver) -> None:
    output = send(receiver, Settings(data_dir=tmp_path))
    assert output.verdict is Verdict.FAILED
    assert output.error is not None and "loopback" in output.error
    assert receiver.requests == []
