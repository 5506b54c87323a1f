"""delta first: a checkpoint published with its delta before its full files (the
parameters and the outer state), which a claimed job makes durable after; what a rebuild of
them needs

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-28 18:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "checkpoints", sa.Column("full_files_at", sa.DateTime(timezone=True), nullable=True)
    )
    # every version so far was published with its full files
    op.execute("UPDATE checkpoints SET full_files_at = created_at")
    op.add_column(
        "checkpoints",
        sa.Column("full_claim_expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.add_column("checkpoints", sa.Column("rebuild", sa.JSON(), nullable=True))
    # what the full-files job looks for: versions whose full files are not yet durable
    op.create_index(
        "ix_checkpoints_full_pending",
        "checkpoints",
        ["created_at"],
        postgresql_where=sa.text("full_files_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_checkpoints_full_pending", table_name="checkpoints")
    op.drop_column("checkpoints", "rebuild")
    op.drop_column("checkpoints", "full_claim_expires_at")
    op.drop_column("checkpoints", "full_files_at")
