"""Tenants and their API keys.

A key is `bi_` + 43 URL-safe characters (256 random bits). Only its SHA-256 is stored,
plus its first characters so an operator can tell keys apart; the plaintext is returned
once, at creation. Functions flush but never commit: the caller owns the transaction.
"""

from __future__ import annotations

import hashlib
import logging
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import ApiKey, Tenant, utcnow

logger = logging.getLogger(__name__)

API_KEY_PREFIX = "bi_"
# Characters of the plaintext kept in `ApiKey.prefix`: "bi_" + 9 random ones.
NUM_KEY_PREFIX_CHARS = 12
DEV_TENANT_NAME = "dev"


class TenantExists(ValueError):
    """A tenant with this name already exists."""


def new_id(kind: str) -> str:
    """A random id such as `ten_3f9a...`: `kind` + "_" + 24 hex characters."""
    return f"{kind}_{secrets.token_hex(12)}"


def hash_api_key(key: str) -> str:
    """SHA-256 hex of a plaintext key, the form stored in `api_keys.key_hash`."""
    return hashlib.sha256(key.encode()).hexdigest()


def create_tenant(session: Session, *, name: str) -> Tenant:
    """Add a tenant; TenantExists if the name is taken."""
    name = name.strip()
    if not name:
        raise ValueError("tenant name must not be empty")
    if len(name) > 200:
        raise ValueError(f"tenant name is {len(name)} characters; at most 200 are allowed")
    if tenant_by_name(session, name=name) is not None:
        raise TenantExists(f"tenant {name!r} already exists; pick another name")
    tenant = Tenant(id=new_id("ten"), name=name, created_at=utcnow())
    session.add(tenant)
    session.flush()
    logger.info("created tenant %s (%s)", tenant.id, name)
    return tenant


def tenant_by_name(session: Session, *, name: str) -> Tenant | None:
    """The tenant called `name`, or None."""
    return session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()


def create_api_key(session: Session, *, tenant_id: str) -> tuple[ApiKey, str]:
    """Mint a key for a tenant; returns the row and the plaintext, which is shown only now."""
    if session.get(Tenant, tenant_id) is None:
        raise ValueError(f"unknown tenant {tenant_id!r}; create the tenant first")
    plaintext = API_KEY_PREFIX + secrets.token_urlsafe(32)
    api_key = ApiKey(
        id=new_id("key"),
        tenant_id=tenant_id,
        key_hash=hash_api_key(plaintext),
        prefix=plaintext[:NUM_KEY_PREFIX_CHARS],
        created_at=utcnow(),
    )
    session.add(api_key)
    session.flush()
    logger.info("created API key %s (%s...) for tenant %s", api_key.id, api_key.prefix, tenant_id)
    return api_key, plaintext


def revoke_api_key(session: Session, *, key_id: str) -> bool:
    """Revoke a key; False if it does not exist or was already revoked."""
    api_key = session.get(ApiKey, key_id)
    if api_key is None or api_key.revoked_at is not None:
        return False
    api_key.revoked_at = utcnow()
    session.flush()
    logger.info("revoked API key %s (%s...)", api_key.id, api_key.prefix)
    return True


def list_api_keys(session: Session, *, tenant_id: str | None = None
                  ) -> list[tuple[ApiKey, Tenant]]:
    """Every key (live and revoked) with its tenant, oldest first; one tenant's with `tenant_id`."""
    query = (select(ApiKey, Tenant).join(Tenant, ApiKey.tenant_id == Tenant.id)
             .order_by(ApiKey.created_at, ApiKey.id))
    if tenant_id is not None:
        query = query.where(ApiKey.tenant_id == tenant_id)
    return [(api_key, tenant) for api_key, tenant in session.execute(query)]


def find_api_key(session: Session, *, ref: str) -> ApiKey:
    """The key an operator names by its id (`key_...`), its listed prefix (`bi_` + 9
    characters) or the key itself; ValueError when none matches, or several share a prefix."""
    ref = ref.strip()
    if ref.startswith("key_"):
        found = session.get(ApiKey, ref)
        matches = [] if found is None else [found]
    elif ref.startswith(API_KEY_PREFIX) and len(ref) > NUM_KEY_PREFIX_CHARS:
        matches = list(session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_api_key(ref))))
    elif ref.startswith(API_KEY_PREFIX) and len(ref) == NUM_KEY_PREFIX_CHARS:
        matches = list(session.scalars(select(ApiKey).where(ApiKey.prefix == ref)))
    else:
        raise ValueError(f"{ref!r} names no key: give its id (key_...), its prefix as "
                         f"`keys list` shows it ({API_KEY_PREFIX} + 9 characters) or the key")
    if not matches:
        raise ValueError(f"no API key matches {ref!r}")
    if len(matches) > 1:
        raise ValueError(f"{len(matches)} keys share the prefix {ref!r}; name one by its id: "
                         + ", ".join(m.id for m in matches))
    return matches[0]


def tenant_for_api_key(session: Session, *, key: str) -> Tenant | None:
    """The tenant owning a live key; None when the key is unknown or revoked."""
    if not key.startswith(API_KEY_PREFIX):
        return None
    query = (
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_api_key(key), ApiKey.revoked_at.is_(None))
    )
    return session.scalars(query).one_or_none()


def ensure_dev_tenant(session: Session, *, rotate: bool = False) -> tuple[Tenant, str | None]:
    """The development tenant, created with a key on first use.

    Returns the plaintext key when one was minted now: on first use, when the tenant has no
    live key, or when `rotate` asks for a fresh one. Otherwise None, because stored keys
    are hashed and cannot be shown again.
    """
    tenant = tenant_by_name(session, name=DEV_TENANT_NAME)
    if tenant is None:
        tenant = create_tenant(session, name=DEV_TENANT_NAME)
    has_live_key = session.scalars(
        select(ApiKey.id).where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None))
    ).first()
    if has_live_key is not None and not rotate:
        return tenant, None
    _, plaintext = create_api_key(session, tenant_id=tenant.id)
    return tenant, plaintext
