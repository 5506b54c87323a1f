"""credit escrow: a contribution's credit is confirmed, pending an audit, or forfeited

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28 15:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # every credit given before escrow stands: confirmed
    op.add_column(
        "contributions",
        sa.Column(
            "credit_status",
            sa.String(length=16),
            server_default=sa.text("'confirmed'"),
            nullable=False,
        ),
    )
    op.create_check_constraint(
        op.f("ck_contributions_credit_status_valid"),
        "contributions",
        "credit_status IN ('confirmed', 'pending', 'forfeited')",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_contributions_credit_status_valid"), "contributions", type_="check")
    op.drop_column("contributions", "credit_status")
