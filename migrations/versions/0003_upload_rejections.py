"""upload rejections: a bounded log of refused uploads, for the dashboard

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 09:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "upload_rejections",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("round_index", sa.Integer(), nullable=False),
        sa.Column("contributor_id", sa.String(length=32), nullable=False),
        sa.Column("code", sa.String(length=64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["contributor_id"],
            ["contributors.id"],
            name=op.f("fk_upload_rejections_contributor_id_contributors"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_upload_rejections_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_upload_rejections")),
    )
    op.create_index(
        "ix_upload_rejections_run_id_round_index",
        "upload_rejections",
        ["run_id", "round_index"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_upload_rejections_run_id_round_index", table_name="upload_rejections")
    op.drop_table("upload_rejections")
