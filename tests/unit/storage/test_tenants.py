"""Tenants and API keys: hashed storage, lookup, revocation, the dev tenant."""

from __future__ import annotations

import hashlib
import re

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import ApiKey, Tenant
from storage.tenants import (
    TenantExists,
    create_api_key,
    create_tenant,
    ensure_dev_tenant,
    revoke_api_key,
    tenant_for_api_key,
)


def test_key_is_returned_once_and_stored_only_as_its_hash(session: Session, tenant: Tenant) -> None:
    api_key, plaintext = create_api_key(session, tenant_id=tenant.id)
    session.commit()
    assert re.fullmatch(r"bi_[A-Za-z0-9_-]{43}", plaintext)
    stored = session.scalars(select(ApiKey)).one()
    assert stored.key_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert stored.prefix == plaintext[:12]
    assert plaintext not in {stored.key_hash, stored.prefix, stored.id}
    assert api_key.id.startswith("key_")


def test_keys_resolve_to_their_own_tenant(
    session: Session, tenant: Tenant, other_tenant: Tenant
) -> None:
    _, key_a = create_api_key(session, tenant_id=tenant.id)
    _, key_b = create_api_key(session, tenant_id=other_tenant.id)
    session.commit()
    assert key_a != key_b
    found_a = tenant_for_api_key(session, key=key_a)
    found_b = tenant_for_api_key(session, key=key_b)
    assert found_a is not None and found_a.id == tenant.id
    assert found_b is not None and found_b.id == other_tenant.id


@pytest.mark.parametrize("key", ["", "bi_nope", "sk-abc", "Bearer bi_x"])
def test_unknown_keys_find_nothing(session: Session, tenant: Tenant, key: str) -> None:
    create_api_key(session, tenant_id=tenant.id)
    session.commit()
    assert tenant_for_api_key(session, key=key) is None


def test_revoked_key_finds_nothing(session: Session, tenant: Tenant) -> None:
    api_key, plaintext = create_api_key(session, tenant_id=tenant.id)
    assert revoke_api_key(session, key_id=api_key.id)
    assert not revoke_api_key(session, key_id=api_key.id)
    session.commit()
    assert tenant_for_api_key(session, key=plaintext) is None


def test_key_for_unknown_tenant_is_refused(session: Session) -> None:
    with pytest.raises(ValueError, match="unknown tenant 'ten_missing'"):
        create_api_key(session, tenant_id="ten_missing")


def test_tenant_names_are_unique_and_non_empty(session: Session, tenant: Tenant) -> None:
    assert tenant.id.startswith("ten_") and len(tenant.id) == 28
    with pytest.raises(TenantExists, match="'acme' already exists"):
        create_tenant(session, name="acme")
    with pytest.raises(ValueError, match="must not be empty"):
        create_tenant(session, name="  ")


def test_dev_tenant_gets_a_key_once_then_none_until_rotated(session: Session) -> None:
    tenant, key = ensure_dev_tenant(session)
    session.commit()
    assert key is not None
    found = tenant_for_api_key(session, key=key)
    assert found is not None and found.id == tenant.id

    again, no_key = ensure_dev_tenant(session)
    assert again.id == tenant.id and no_key is None

    _, rotated = ensure_dev_tenant(session, rotate=True)
    session.commit()
    assert rotated is not None and rotated != key
    assert tenant_for_api_key(session, key=key) is not None
    assert len(session.scalars(select(Tenant)).all()) == 1
