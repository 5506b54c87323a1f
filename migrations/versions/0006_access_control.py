"""access control: a contributor can be banned (when, and the admin's reason)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 18:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("contributors", sa.Column("banned_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("contributors", sa.Column("ban_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("contributors", "ban_reason")
    op.drop_column("contributors", "banned_at")
