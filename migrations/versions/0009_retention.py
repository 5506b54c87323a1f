"""retention: when a version's files and a contribution's blob were deleted (rows stay)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 21:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "checkpoints", sa.Column("files_deleted_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column(
        "contributions", sa.Column("blob_deleted_at", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("contributions", "blob_deleted_at")
    op.drop_column("checkpoints", "files_deleted_at")
