"""Fixtures for callback unit tests: a SQLite file with every table, and a tenant."""

from __future__ import annotations

import storage.webhooks  # noqa: F401  (registers the webhook tables on Base)
from tests.utils.sqlite_db import engine, session, sessions, tenant

__all__ = ["engine", "session", "sessions", "tenant"]
