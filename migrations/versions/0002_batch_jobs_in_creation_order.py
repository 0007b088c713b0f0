"""Batch jobs in creation order: index jobs (batch_id, created_at, id).

Output and error files list a batch's jobs in input order, a page at a time
(storage.batch_jobs.iter_batch_jobs); this index makes each page a range scan.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ix_jobs_batch_created."""
    op.create_index("ix_jobs_batch_created", "jobs", ["batch_id", "created_at", "id"],
                    unique=False)


def downgrade() -> None:
    """Drop ix_jobs_batch_created."""
    op.drop_index("ix_jobs_batch_created", table_name="jobs")
