"""Database fixtures for unit tests: a fresh SQLite file per test, schema from the models.

A unit-test package's conftest imports the fixtures it needs from here, so every package
gets the same engine, sessions and tenant; tables a package needs beyond those the
storage models register are registered by importing their module in that conftest.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy
from sqlalchemy.orm import Session, sessionmaker

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
    """One session; tests commit when they need the data visible elsewhere."""
    with sessions() as session:
        yield session


@pytest.fixture
def tenant(session: Session) -> Tenant:
    """A committed tenant named acme."""
    tenant = create_tenant(session, name="acme")
    session.commit()
    return tenant
