"""Schema migrations as a Python API: what `batchinfer db upgrade|downgrade` calls.

Responsible for: finding the Alembic scripts (next to the `migrations` package, so an
installed wheel works as well as a checkout), building their config for a URL, running
upgrades and downgrades, and collecting every table model under `storage/` into the
metadata that autogenerate compares against.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import MetaData

import migrations
import storage
from storage.models import Base

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent


def target_metadata() -> MetaData:
    """The metadata of every table model in the storage package.

    Table classes live in several modules (`storage.models`, `storage.files`, ...); each
    is imported so its tables register on the shared `Base` before Alembic compares.
    """
    for module in pkgutil.iter_modules(storage.__path__):
        if module.name != "migrate":
            importlib.import_module(f"storage.{module.name}")
    return Base.metadata


def alembic_config(url: str) -> Config:
    """An Alembic config for our scripts, pointed at `url`, leaving app logging alone."""
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # configparser interpolation: a literal % (e.g. in an escaped password) must be %%.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["configure_logger"] = False
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision` (default: the newest)."""
    _require_url(url)
    logger.info("upgrading database schema to %s", revision)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at `url` down to `revision` (default: no tables at all)."""
    _require_url(url)
    logger.info("downgrading database schema to %s", revision)
    command.downgrade(alembic_config(url), revision)


def _require_url(url: str) -> None:
    """Refuse an empty URL rather than silently migrating the configured database."""
    if not url:
        raise ValueError(
            "database URL is empty: pass e.g. sqlite:///.data/batchinfer.db or "
            "postgresql+psycopg://user:password@host:5432/dbname"
        )
