"""Database engines and sessions for SQLite (embedded default) and PostgreSQL.

Responsible for: building an engine from a URL with the per-backend settings the service
relies on (SQLite: WAL journal, foreign keys, a busy timeout, its directory created;
PostgreSQL: pre-ping so a restarted server does not fail the first request), and the
session factory every role uses. Nothing is built at import time.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry, StaticPool

logger = logging.getLogger(__name__)

# Seconds a SQLite writer waits for another writer's lock before "database is locked".
SQLITE_BUSY_TIMEOUT_S = 30.0


# numpy arrays are written by orjson itself, each float32 in its shortest decimal form:
# an embedding result carries its vectors as float32 arrays (workers.inference.embedding_jobs)
# instead of Python floats, which a worker built at ~10 us a vector and orjson then wrote
# again, per result, on the worker's one thread.
ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def stdlib_json_default(value: Any) -> Any:
    """`default=` for the standard library's json: what orjson would write for a value it
    knows and json does not (a numpy array), as plain JSON values; TypeError otherwise."""
    return orjson.loads(orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY))


def _dumps(value: Any) -> str:
    try:
        return orjson.dumps(value, option=ORJSON_OPTIONS).decode()
    except orjson.JSONEncodeError:
        # A lone surrogate in a free-form field of a request (valid JSON escapes it, UTF-8
        # cannot hold it): the standard library writes it as its escape, as it always did.
        return json.dumps(value, default=stdlib_json_default)


def _loads(text: str | bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)  # such an escape, read back


# JSON columns (request bodies, results) through orjson: a result holding an embedding is
# hundreds of floats, which the standard library formats ~10x slower, per job, in the
# worker's result write and again when a batch's output file is read back.
JSON_CODEC: dict[str, Any] = {"json_serializer": _dumps, "json_deserializer": _loads}


def create_db_engine(url: str, *, pool_size: int | None = None) -> sqlalchemy.Engine:
    """An engine for `url`; SQLite gets WAL, foreign keys and a busy timeout. `pool_size`:
    connections kept open (SQLAlchemy's default, 5, if None)."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise ValueError(
            f"invalid database URL {url!r}: use sqlite:///path/to/file.db "
            "or postgresql+psycopg://user:password@host:5432/dbname"
        ) from e
    pool: dict[str, Any] = {} if pool_size is None else {"pool_size": pool_size}
    if parsed.get_backend_name() != "sqlite":
        return sqlalchemy.create_engine(parsed, pool_pre_ping=True, **pool, **JSON_CODEC)

    database = parsed.database or ""
    in_memory = database in ("", ":memory:") or database.startswith("file::memory:")
    kwargs: dict[str, Any] = {
        "connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False},
        **JSON_CODEC,
    }
    if in_memory:
        # One shared connection, else every pooled connection would see its own empty db.
        kwargs["poolclass"] = StaticPool
    else:
        Path(database).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
        kwargs.update(pool)
    engine = sqlalchemy.create_engine(parsed, **kwargs)
    event.listen(engine, "connect", _configure_sqlite_connection)
    logger.debug("sqlite engine for %s", database or ":memory:")
    return engine


def _configure_sqlite_connection(
    dbapi_connection: sqlite3.Connection, connection_record: ConnectionPoolEntry
) -> None:
    """Per-connection pragmas; SQLite forgets them between connections."""
    cursor = dbapi_connection.cursor()
    try:
        # WAL lets API readers run while a worker writes; NORMAL sync is still safe against
        # a killed process (only a power cut can lose the last commits).
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
    finally:
        cursor.close()


def session_factory(engine: sqlalchemy.Engine) -> sessionmaker[Session]:
    """Sessions bound to `engine`; objects stay readable after commit."""
    return sessionmaker(bind=engine, expire_on_commit=False)
