"""A worker's decode step of one sequence alone, carried by its heartbeat.

A job longer than the work beside it (256 output tokens behind a backlog of 64-token
lines) decodes its last tokens alone once that work is drained, each step far shorter than
a step of the full batch; counting every one of its steps at the batch's width put its ETA
up to a third late (bench/eta_accuracy.py). Each worker now reports the seconds its
engine's fitted step cost gives for a step of one sequence. NULL: not reported (an older
worker, a remote engine, a cost not fitted yet); the estimates then count every step at the
measured width, as before.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add workers.solo_step_s."""
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("solo_step_s", sa.Float(), nullable=True))


def downgrade() -> None:
    """Drop it again."""
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("solo_step_s")
