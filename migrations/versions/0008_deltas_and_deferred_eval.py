"""int8 deltas between versions, and the eval loss filled in after a version is published

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 20:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("delta_key", sa.Text(), nullable=True))
    op.add_column("checkpoints", sa.Column("delta_sha256", sa.String(length=64), nullable=True))
    op.add_column("checkpoints", sa.Column("delta_nbytes", sa.BigInteger(), nullable=True))
    op.add_column(
        "checkpoints",
        sa.Column("eval_claim_expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index(
        "ix_checkpoints_eval_pending",
        "checkpoints",
        ["created_at"],
        postgresql_where=sa.text("eval_loss IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_checkpoints_eval_pending", table_name="checkpoints")
    op.drop_column("checkpoints", "eval_claim_expires_at")
    op.drop_column("checkpoints", "delta_nbytes")
    op.drop_column("checkpoints", "delta_sha256")
    op.drop_column("checkpoints", "delta_key")
