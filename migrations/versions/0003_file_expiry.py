"""File expiry: files.expires_at (indexed) and batches.output_expires_after_s.

OpenAI's `expires_after` on uploads and `output_expires_after` on batches; the scheduler
finds expired files through ix_files_expires_at.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add files.expires_at with its index, and batches.output_expires_after_s."""
    op.add_column("files", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_files_expires_at", "files", ["expires_at"], unique=False)
    op.add_column("batches", sa.Column("output_expires_after_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop them again."""
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_column("output_expires_after_s")
    op.drop_index("ix_files_expires_at", table_name="files")
    with op.batch_alter_table("files") as batch_op:
        batch_op.drop_column("expires_at")
