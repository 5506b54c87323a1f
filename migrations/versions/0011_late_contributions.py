"""late contributions: the round whose step takes a contribution, and its staleness

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("contributions", sa.Column("merged_into_round", sa.Integer(), nullable=True))
    op.execute("UPDATE contributions SET merged_into_round = round_index")
    op.alter_column("contributions", "merged_into_round", nullable=False)
    op.add_column(
        "contributions",
        sa.Column("staleness", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.create_foreign_key(
        op.f("fk_contributions_run_id_merged_into_round_rounds"),
        "contributions",
        "rounds",
        ["run_id", "merged_into_round"],
        ["run_id", "index"],
        ondelete="CASCADE",
    )
    op.create_index(
        "ix_contributions_run_id_merged_into_round_payload_sha256",
        "contributions",
        ["run_id", "merged_into_round", "payload_sha256"],
        unique=True,
    )


def downgrade() -> None:
    op.drop_index(
        "ix_contributions_run_id_merged_into_round_payload_sha256", table_name="contributions"
    )
    op.drop_constraint(
        op.f("fk_contributions_run_id_merged_into_round_rounds"),
        "contributions",
        type_="foreignkey",
    )
    op.drop_column("contributions", "staleness")
    op.drop_column("contributions", "merged_into_round")
