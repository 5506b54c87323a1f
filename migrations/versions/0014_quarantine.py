"""quarantine: a contributor whose work keeps failing verification (diloco.protocol.reputation)

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28 03:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "contributors", sa.Column("quarantined_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("contributors", sa.Column("quarantine_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("contributors", "quarantine_reason")
    op.drop_column("contributors", "quarantined_at")
