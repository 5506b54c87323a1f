"""close claims and errors: a closing round's claim, failed closes, excluded contributions

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _round_columns() -> list[sa.Column]:
    return [
        sa.Column("leases_issued", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("claim_token", sa.String(length=32), nullable=True),
        sa.Column("claim_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("close_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error_code", sa.String(length=32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("error_at", sa.DateTime(timezone=True), nullable=True),
    ]


def _contribution_columns() -> list[sa.Column]:
    return [
        sa.Column("excluded_code", sa.String(length=32), nullable=True),
        sa.Column("excluded_reason", sa.Text(), nullable=True),
    ]


def upgrade() -> None:
    for column in _round_columns():
        op.add_column("rounds", column)
    for column in _contribution_columns():
        op.add_column("contributions", column)
    # leases handed out so far per round: the ordinal that picks a new lease's shard and seed
    op.execute(
        "UPDATE rounds SET leases_issued = (SELECT count(*) FROM leases "
        "WHERE leases.run_id = rounds.run_id AND leases.round_index = rounds.index)"
    )
    op.create_index(
        "ix_rounds_unfinished",
        "rounds",
        ["state"],
        unique=False,
        postgresql_where=sa.text("state <> 'closed'"),
    )


def downgrade() -> None:
    op.drop_index("ix_rounds_unfinished", table_name="rounds")
    for column in reversed(_contribution_columns()):
        op.drop_column("contributions", column.name)
    for column in reversed(_round_columns()):
        op.drop_column("rounds", column.name)
