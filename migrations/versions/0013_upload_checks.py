"""upload checks: each round's secret sampling seed and its published change, sampled; each
contribution's checks (diloco.outer.checks)

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28 02:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # rounds that exist get a random seed each; new ones get theirs from the server
    op.add_column(
        "rounds",
        sa.Column(
            "check_seed",
            sa.BigInteger(),
            nullable=False,
            server_default=sa.text("floor(random() * 4611686018427387904)::bigint"),
        ),
    )
    op.add_column("rounds", sa.Column("change_sample", sa.LargeBinary(), nullable=True))
    op.add_column("contributions", sa.Column("checks", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("contributions", "checks")
    op.drop_column("rounds", "change_sample")
    op.drop_column("rounds", "check_seed")
