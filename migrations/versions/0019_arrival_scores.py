"""arrival scores: a contribution's score by the loss, taken as it arrives, and the claim
of the worker taking it

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-28 15:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("contributions", sa.Column("score", sa.JSON(), nullable=True))
    op.add_column(
        "contributions",
        sa.Column("score_claim_expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    # what the scorer looks for: contributions not yet scored, in rounds not yet closed
    op.create_index(
        "ix_contributions_unscored",
        "contributions",
        ["created_at"],
        postgresql_where=sa.text("score IS NULL AND aggregated_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_contributions_unscored", table_name="contributions")
    op.drop_column("contributions", "score_claim_expires_at")
    op.drop_column("contributions", "score")
