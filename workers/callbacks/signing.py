"""Standard Webhooks signatures: `webhook-id`, `webhook-timestamp`, `webhook-signature`.

The signed content is `<webhook-id>.<webhook-timestamp>.<body>`; the signature is
`v1,` + base64(HMAC-SHA256(key, content)), the key being the base64-decoded part of the
tenant's `whsec_...` secret. While a secret is being rotated, one signature per valid
secret is sent, space-separated, so receivers holding either secret can verify.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from storage.webhook_secrets import SECRET_PREFIX

SIGNATURE_VERSION = "v1"


def secret_key(secret: str) -> bytes:
    """The HMAC key inside a `whsec_` secret; ValueError when it is not one."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"webhook secret must start with {SECRET_PREFIX!r}")
    try:
        return base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except ValueError as e:
        raise ValueError("webhook secret is not valid base64 after its prefix") from e


def sign(*, secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """One `v1,<base64>` signature of `id.timestamp.body` with the secret."""
    content = f"{webhook_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), content, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def signature_headers(
    *, secrets_in_use: list[str], webhook_id: str, timestamp: int, body: bytes
) -> dict[str, str]:
    """The three Standard Webhooks headers, signed with every secret in use (newest first)."""
    if not secrets_in_use:
        raise ValueError("at least one webhook secret is needed to sign")
    signatures = [
        sign(secret=secret, webhook_id=webhook_id, timestamp=timestamp, body=body)
        for secret in secrets_in_use
    ]
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signatures),
    }
