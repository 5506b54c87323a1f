"""lease inner steps: each lease's H, sized to its volunteer's speed (null: the run's steps)

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-30 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("leases", sa.Column("inner_steps", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("leases", "inner_steps")
