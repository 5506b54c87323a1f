"""accounts and credit: contributors' last_seen_at and hardware, contributions' credit

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 10:12:40.118204
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "contributors", sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column(
        "contributors",
        sa.Column("hardware", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    )
    op.add_column(
        "contributions", sa.Column("aggregated_at", sa.DateTime(timezone=True), nullable=True)
    )
    # existing rows get 0: credit is only ever earned when a round closes from now on
    op.add_column(
        "contributions",
        sa.Column("credit", sa.Float(), server_default=sa.text("0"), nullable=False),
    )
    # (contributor_id, created_at) serves everything the single-column index did, and more
    op.drop_index(op.f("ix_contributions_contributor_id"), table_name="contributions")
    op.create_index(
        "ix_contributions_contributor_id_created_at",
        "contributions",
        ["contributor_id", "created_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_contributions_contributor_id_created_at", table_name="contributions")
    op.create_index(
        op.f("ix_contributions_contributor_id"), "contributions", ["contributor_id"], unique=False
    )
    op.drop_column("contributions", "credit")
    op.drop_column("contributions", "aggregated_at")
    op.drop_column("contributors", "hardware")
    op.drop_column("contributors", "last_seen_at")
