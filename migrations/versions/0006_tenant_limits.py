"""Tenant limits: token budgets per minute and per day, and a fair-share weight.

One row per tenant for all its models (`model` "*") and optionally one per tenant and
model; `batchinfer tenants set-limits` writes them, the API and the batch fan-out read
them (`storage.tenant_limits`).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create `tenant_limits`."""
    op.create_table(
        "tenant_limits",
        sa.Column("tenant_id", sa.String(length=40),
                  sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("model", sa.String(length=200), primary_key=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_day", sa.Integer(), nullable=True),
        sa.Column("weight", sa.Float(), nullable=False, server_default="1"),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    """Drop `tenant_limits`."""
    op.drop_table("tenant_limits")
