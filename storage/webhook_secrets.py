"""Per-tenant webhook signing secrets: create on first use, rotate with an overlap.

After a rotation the previous secret keeps signing (next to the new one) for
`ROTATION_OVERLAP`, so receivers can switch to the new secret without rejecting
anything in between. Functions flush but never commit: the caller owns the transaction.
"""

from __future__ import annotations

import base64
import logging
import secrets
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from storage.models import Tenant, utcnow
from storage.webhooks import WebhookSecret

logger = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
SECRET_NUM_BYTES = 32
# How long the replaced secret still signs after a rotation (Standard Webhooks' advice).
ROTATION_OVERLAP = timedelta(hours=24)


def generate_secret() -> str:
    """A new `whsec_` secret: the prefix and 32 random bytes in base64."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_NUM_BYTES)).decode()


def ensure_webhook_secret(session: Session, *, tenant_id: str) -> WebhookSecret:
    """The tenant's secret row, created with a fresh secret if it has none yet."""
    row = session.get(WebhookSecret, tenant_id)
    if row is not None:
        return row
    if session.get(Tenant, tenant_id) is None:
        raise ValueError(f"unknown tenant {tenant_id!r}; create the tenant first")
    row = WebhookSecret(tenant_id=tenant_id, secret=generate_secret(), created_at=utcnow())
    session.add(row)
    session.flush()
    logger.info("created webhook secret for tenant %s", tenant_id)
    return row


def rotate_webhook_secret(session: Session, *, tenant_id: str) -> WebhookSecret:
    """Replace the tenant's secret; the old one keeps signing for ROTATION_OVERLAP."""
    row = ensure_webhook_secret(session, tenant_id=tenant_id)
    row.previous_secret = row.secret
    row.secret = generate_secret()
    row.rotated_at = utcnow()
    session.flush()
    logger.info("rotated webhook secret for tenant %s", tenant_id)
    return row


def signing_secrets(
    session: Session, *, tenant_id: str, now: datetime | None = None
) -> list[str]:
    """Secrets to sign with now, newest first: the current one, the previous during overlap."""
    row = ensure_webhook_secret(session, tenant_id=tenant_id)
    in_use = [row.secret]
    if row.previous_secret and row.rotated_at is not None:
        if (now or utcnow()) - row.rotated_at < ROTATION_OVERLAP:
            in_use.append(row.previous_secret)
    return in_use
