"""The work a worker's in-flight jobs have left, carried by its heartbeat.

A batch larger than nothing but smaller than a few engine batches finishes in waves: the
engine runs hundreds of sequences together, so when the first lines of a wave finish the
rest of it is nearly done too. Counting every running job as a whole job's work put such
batches' ETAs two to three times too far (bench/eta_accuracy.py, SmolLM2). Each worker now
reports what its engine's live requests have left: how many, the tokens the model will
compute for them if each runs to its max_tokens, and of those the tokens still to be
generated (scaled by the output share finished jobs used). NULL: not reported (an older
worker, or a remote engine); the estimates then count those jobs whole, as before.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add workers.num_requests_left, num_tokens_to_compute and num_output_tokens_left."""
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("num_requests_left", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("num_tokens_to_compute", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("num_output_tokens_left", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop them again."""
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("num_output_tokens_left")
        batch.drop_column("num_tokens_to_compute")
        batch.drop_column("num_requests_left")
