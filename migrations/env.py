"""Alembic environment: which database, which metadata, and how to compare them.

The URL comes from the Alembic config (`storage.migrate` sets it; the alembic CLI takes
`-x url=...`) and otherwise from `core.settings.get_settings().database_url`. A caller
may also hand over an open connection in `config.attributes["connection"]`.
"""

from __future__ import annotations

import logging
from logging.config import fileConfig
from typing import Any, Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy.engine import Connection
from sqlalchemy.types import TypeDecorator

from core.settings import get_settings
from storage.db import create_db_engine
from storage.migrate import target_metadata

logger = logging.getLogger(__name__)

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def database_url() -> str:
    """-x url=..., else the config's sqlalchemy.url, else the settings' database_url."""
    url = context.get_x_argument(as_dictionary=True).get("url")
    return url or config.get_main_option("sqlalchemy.url") or get_settings().database_url


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    """Render our TypeDecorators as their plain SQL type: a migration must not import the app.

    UTCDateTime → sa.DateTime(timezone=True); the zone handling is Python-side only.
    """
    if type_ == "type" and isinstance(obj, TypeDecorator):
        return f"sa.{obj.impl!r}"
    return False


def configure(connection: Connection) -> None:
    """Bind the migration context; SQLite alters tables in batch (copy-and-move) mode."""
    context.configure(
        connection=connection,
        target_metadata=target_metadata(),
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
        render_item=render_item,
    )


def run_migrations_offline() -> None:
    """Emit SQL to stdout instead of running it (`alembic upgrade --sql`)."""
    url = database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata(),
        literal_binds=True,
        compare_type=True,
        render_as_batch=url.startswith("sqlite"),
        render_item=render_item,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run against a live database, on the given connection or a new engine."""
    given = config.attributes.get("connection")
    if given is not None:
        configure(given)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_db_engine(database_url())
    try:
        with engine.connect() as connection:
            if connection.dialect.name == "sqlite":
                # Batch mode copies tables; enforced foreign keys would cascade on the drop.
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()
            configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
