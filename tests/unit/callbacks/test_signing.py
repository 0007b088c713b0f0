"""Signatures checked by the independent `standardwebhooks` implementation."""

from __future__ import annotations

import time

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from storage.webhook_secrets import generate_secret
from workers.callbacks.signing import secret_key, sign, signature_headers

BODY = b'{"type":"job.succeeded","data":{"id":"job_1"}}'


def test_signature_verifies_with_standardwebhooks() -> None:
    secret = generate_secret()
    headers = signature_headers(secrets_in_use=[secret], webhook_id="msg_abc",
                                timestamp=int(time.time()), body=BODY)
    assert headers["webhook-id"] == "msg_abc"
    assert headers["webhook-signature"].startswith("v1,")
    assert Webhook(secret).verify(BODY, headers) == {"type": "job.succeeded",
                                                     "data": {"id": "job_1"}}


def test_tampered_body_or_other_secret_fails() -> None:
    secret = generate_secret()
    headers = signature_headers(secrets_in_use=[secret], webhook_id="msg_abc",
                                timestamp=int(time.time()), body=BODY)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(BODY.replace(b"job_1", b"job_2"), headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(generate_secret()).verify(BODY, headers)


def test_rotation_sends_both_signatures_each_verifying() -> None:
    new, old = generate_secret(), generate_secret()
    headers = signature_headers(secrets_in_use=[new, old], webhook_id="msg_abc",
                                timestamp=int(time.time()), body=BODY)
    signatures = headers["webhook-signature"].split(" ")
    assert len(signatures) == 2
    timestamp = int(headers["webhook-timestamp"])
    assert signatures[0] == sign(secret=new, webhook_id="msg_abc", timestamp=timestamp, body=BODY)
    assert signatures[1] == sign(secret=old, webhook_id="msg_abc", timestamp=timestamp, body=BODY)
    # A receiver holding either secret accepts the message.
    Webhook(new).verify(BODY, headers)
    Webhook(old).verify(BODY, headers)


def test_timestamp_is_part_of_the_signature() -> None:
    secret = generate_secret()
    first = sign(secret=secret, webhook_id="msg_abc", timestamp=1000, body=BODY)
    assert first != sign(secret=secret, webhook_id="msg_abc", timestamp=1001, body=BODY)


def test_generated_secret_holds_32_key_bytes() -> None:
    assert len(secret_key(generate_secret())) == 32


@pytest.mark.parametrize("bad", ["", "abc", "whsec_!!!notbase64"])
def test_bad_secret_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="webhook secret"):
        secret_key(bad)


def test_signing_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="at least one"):
        signature_headers(secrets_in_use=[], webhook_id="msg_abc", timestamp=1, body=BODY)
