"""Estimates and deadlines: each worker's model and measured service rate; job deadlines.

`workers.model`, `workers.tokens_per_s` and `workers.step_s` let the API estimate, per
served model, when queued work starts and finishes. `jobs.deadline` orders work within a
priority (earliest first) and expires jobs that pass it (status `expired`, a new value of
PostgreSQL's job_status type); the reconciler finds them through ix_jobs_status_deadline.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the columns, the deadline index and the `expired` job status."""
    if op.get_bind().dialect.name == "postgresql":
        with op.get_context().autocommit_block():  # ADD VALUE outside the transaction
            op.execute("ALTER TYPE job_status ADD VALUE IF NOT EXISTS 'expired'")
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("model", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("tokens_per_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("step_s", sa.Float(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("deadline", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_jobs_status_deadline", "jobs", ["status", "deadline"])


def downgrade() -> None:
    """Drop them again; PostgreSQL keeps the enum value (it cannot drop one), and expired
    jobs read as cancelled."""
    op.execute("UPDATE jobs SET status = 'cancelled' WHERE status = 'expired'")
    op.drop_index("ix_jobs_status_deadline", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("deadline")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("step_s")
        batch.drop_column("tokens_per_s")
        batch.drop_column("model")
