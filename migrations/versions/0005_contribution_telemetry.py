"""contribution telemetry: weight, norm, payload digest, cosine and clip factor

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 16:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _columns() -> list[sa.Column]:
    return [
        sa.Column("weight", sa.BigInteger(), nullable=True),
        sa.Column("norm", sa.Float(), nullable=True),
        sa.Column("payload_sha256", sa.String(length=64), nullable=True),
        sa.Column("cosine", sa.Float(), nullable=True),
        sa.Column("clip_factor", sa.Float(), nullable=True),
    ]


def upgrade() -> None:
    for column in _columns():
        op.add_column("contributions", column)
    # contributions from before: they counted for the tokens they claimed
    op.execute("UPDATE contributions SET weight = tokens")
    op.create_index(
        "ix_contributions_run_id_round_index_payload_sha256",
        "contributions",
        ["run_id", "round_index", "payload_sha256"],
        unique=True,
    )


def downgrade() -> None:
    op.drop_index("ix_contributions_run_id_round_index_payload_sha256", table_name="contributions")
    for column in reversed(_columns()):
        op.drop_column("contributions", column.name)
