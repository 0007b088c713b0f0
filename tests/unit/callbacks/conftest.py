"""Fixtures for callback unit tests: a SQLite file with every table, and a tenant."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy
from sqlalchemy.orm import Session, sessionmaker

import storage.webhooks  # noqa: F401  (registers the webhook tables on Base)
from storage.db import create_db_engine, session_factory
from storage.models import Base, Tenant
from storage.tenants import create_tenant


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sqlalchemy.Engine]:
    """An engine on an empty SQLite file with every table created."""
    engine = create_db_engine(f"sqlite:///{tmp_path / 'db' / 'test.db'}")
    Base.metadata.create_all(engine)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def sessions(engine: sqlalchemy.Engine) -> sessionmaker[Session]:
    """The session factory, for tests that need two sessions racing."""
    return session_factory(engine)


@pytest.fixture
def session(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """One session."""
    with sessions() as session:
        yield session


@pytest.fixture
def tenant(session: Session) -> Tenant:
    """A committed tenant."""
    tenant = create_tenant(session, name="acme")
    session.commit()
    return tenant
