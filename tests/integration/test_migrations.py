"""Alembic migrations on SQLite and PostgreSQL: up to head, down to base, no drift."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from storage.db import create_db_engine
from storage.migrate import MIGRATIONS_DIR, alembic_config, downgrade, target_metadata, upgrade

ENUM_TYPES = {"job_status", "batch_status", "webhook_delivery_status"}


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database on each backend (PostgreSQL from the shared fixture)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh' / 'migrate.db'}"
    else:
        yield request.getfixturevalue("postgres_url")


def table_names(url: str) -> set[str]:
    """The tables the database holds now."""
    engine = create_db_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def schema_diff(url: str) -> list[Any]:
    """What autogenerate would still change to make the database match the models."""
    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, target_metadata()))
    finally:
        engine.dispose()


def current_revision(url: str) -> str | None:
    """The revision stamped in alembic_version."""
    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def enum_types(url: str) -> set[str]:
    """PostgreSQL enum type names in the database."""
    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(sa.text("SELECT typname FROM pg_type WHERE typtype = 'e'"))
            return {row[0] for row in rows}
    finally:
        engine.dispose()


def test_upgrade_matches_models_and_downgrade_removes_everything(database_url: str) -> None:
    head = ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
    model_tables = set(target_metadata().tables)
    assert {"tenants", "api_keys", "jobs"} <= model_tables

    upgrade(database_url)
    assert table_names(database_url) == model_tables | {"alembic_version"}
    assert current_revision(database_url) == head
    assert schema_diff(database_url) == []
    if database_url.startswith("postgresql"):
        assert ENUM_TYPES <= enum_types(database_url)

    downgrade(database_url)
    assert table_names(database_url) == {"alembic_version"}
    assert current_revision(database_url) is None
    if database_url.startswith("postgresql"):
        assert enum_types(database_url) == set()

    # The round trip repeats cleanly, e.g. after a downgrade for a rollback.
    upgrade(database_url)
    assert schema_diff(database_url) == []
    upgrade(database_url)
    assert current_revision(database_url) == head


def test_every_revision_downgrades_to_its_predecessor(database_url: str) -> None:
    script = ScriptDirectory.from_config(alembic_config(database_url))
    revisions = [rev.revision for rev in reversed(list(script.walk_revisions()))]
    for revision in revisions:
        upgrade(database_url, revision=revision)
        assert current_revision(database_url) == revision
    for previous in [*reversed(revisions[:-1]), None]:
        downgrade(database_url, revision=previous or "base")
        assert current_revision(database_url) == previous


def test_scripts_ship_with_the_migrations_package() -> None:
    # storage.migrate finds them next to the `migrations` package, not the working dir.
    assert (MIGRATIONS_DIR / "alembic.ini").is_file()
    assert (MIGRATIONS_DIR / "script.py.mako").is_file()
    assert (MIGRATIONS_DIR / "env.py").is_file()
    assert sorted(p.name for p in (MIGRATIONS_DIR / "versions").glob("*.py"))


def test_empty_url_is_refused() -> None:
    with pytest.raises(ValueError, match="database URL is empty"):
        upgrade("")
