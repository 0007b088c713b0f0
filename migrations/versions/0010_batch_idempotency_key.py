"""An Idempotency-Key on batch creation.

A client that retried `POST /v1/batches` after a timeout created a second batch and ran
every line twice. The key and a hash of the body are kept with the batch: the same key
with the same body answers with the first batch, with another body 409. NULL: created
without a key (NULLs never collide under the unique constraint).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add batches.idempotency_key and batches.request_hash, one key per tenant."""
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("idempotency_key", sa.String(200), nullable=True))
        batch.add_column(sa.Column("request_hash", sa.String(64), nullable=True))
        batch.create_unique_constraint("uq_batches_tenant_idempotency_key",
                                       ["tenant_id", "idempotency_key"])


def downgrade() -> None:
    """Drop them again."""
    with op.batch_alter_table("batches") as batch:
        batch.drop_constraint("uq_batches_tenant_idempotency_key", type_="unique")
        batch.drop_column("request_hash")
        batch.drop_column("idempotency_key")
