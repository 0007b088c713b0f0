"""Fixtures for storage unit tests: a fresh SQLite file per test, schema from the models."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session

from storage.models import Tenant
from storage.tenants import create_tenant
from tests.utils.sqlite_db import engine, session, sessions, tenant

__all__ = ["engine", "session", "sessions", "tenant"]


@pytest.fixture
def other_tenant(session: Session) -> Tenant:
    """A second committed tenant, to check isolation."""
    tenant = create_tenant(session, name="globex")
    session.commit()
    return tenant
