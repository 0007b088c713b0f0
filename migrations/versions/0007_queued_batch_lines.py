"""Queued batch lines: a partial index of queued batch jobs by model, priority and tenant.

The batch fan-out's window is counted per (model, priority), with each tenant's share,
once a scheduler pass (scheduler.fanout_plan); ix_jobs_queued_batch_lines holds only the
queued batch jobs (about a window per pair), so the count reads a small index and every
other job costs it nothing. On PostgreSQL it is built CONCURRENTLY: the jobs table stays
writable while the build reads it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# storage.models.QUEUED_BATCH_JOB as of this revision.
PREDICATE = "status = 'queued' AND batch_id IS NOT NULL"


def upgrade() -> None:
    """Add ix_jobs_queued_batch_lines."""
    columns = ["model", "priority", "tenant_id"]
    where = sa.text(PREDICATE)
    if op.get_bind().dialect.name == "postgresql":
        with op.get_context().autocommit_block():  # CONCURRENTLY runs outside a transaction
            op.create_index("ix_jobs_queued_batch_lines", "jobs", columns,
                            postgresql_where=where, postgresql_concurrently=True)
    else:
        op.create_index("ix_jobs_queued_batch_lines", "jobs", columns, sqlite_where=where)


def downgrade() -> None:
    """Drop ix_jobs_queued_batch_lines."""
    op.drop_index("ix_jobs_queued_batch_lines", table_name="jobs")
