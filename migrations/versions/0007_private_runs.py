"""private runs: an invite code per run (hashed), and the contributors admitted with it

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 19:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("invite_hash", sa.String(length=64), nullable=True))
    op.create_table(
        "run_members",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("contributor_id", sa.String(length=32), nullable=False),
        sa.Column("joined_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["contributor_id"],
            ["contributors.id"],
            name=op.f("fk_run_members_contributor_id_contributors"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_members_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "contributor_id", name=op.f("pk_run_members")),
    )
    op.create_index(
        op.f("ix_run_members_contributor_id"), "run_members", ["contributor_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_run_members_contributor_id"), table_name="run_members")
    op.drop_table("run_members")
    op.drop_column("runs", "invite_hash")
