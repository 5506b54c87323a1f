"""audits by replay: each upload's replay record, the audits drawn, and contributor roles;
each contribution's standing (the share of its weight its contributor had earned)

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("contributions", sa.Column("replay", sa.JSON(), nullable=True))
    op.add_column("contributions", sa.Column("standing", sa.Float(), nullable=True))
    op.create_table(
        "audits",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("round_index", sa.Integer(), nullable=False),
        sa.Column("contribution_id", sa.String(length=32), nullable=False),
        sa.Column("contributor_id", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("state_key", sa.Text(), nullable=True),
        sa.Column("state_nbytes", sa.BigInteger(), nullable=True),
        sa.Column("reveal_by", sa.DateTime(timezone=True), nullable=False),
        sa.Column("claimed_by", sa.String(length=32), nullable=True),
        sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cosine", sa.Float(), nullable=True),
        sa.Column("rel_error", sa.Float(), nullable=True),
        sa.Column("norm_ratio", sa.Float(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('revealing', 'pending', 'passed', 'failed')",
            name=op.f("ck_audits_status_valid"),
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "round_index"],
            ["rounds.run_id", "rounds.index"],
            name=op.f("fk_audits_run_id_rounds"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["contribution_id"],
            ["contributions.id"],
            name=op.f("fk_audits_contribution_id_contributions"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["contributor_id"],
            ["contributors.id"],
            name=op.f("fk_audits_contributor_id_contributors"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audits")),
        sa.UniqueConstraint("contribution_id", name=op.f("uq_audits_contribution_id")),
    )
    op.create_index(op.f("ix_audits_run_id_status"), "audits", ["run_id", "status"])
    op.create_table(
        "contributor_roles",
        sa.Column("contributor_id", sa.String(length=32), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("role IN ('verifier')", name=op.f("ck_contributor_roles_role_valid")),
        sa.ForeignKeyConstraint(
            ["contributor_id"],
            ["contributors.id"],
            name=op.f("fk_contributor_roles_contributor_id_contributors"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("contributor_id", "role", name=op.f("pk_contributor_roles")),
    )


def downgrade() -> None:
    op.drop_table("contributor_roles")
    op.drop_index(op.f("ix_audits_run_id_status"), table_name="audits")
    op.drop_table("audits")
    op.drop_column("contributions", "standing")
    op.drop_column("contributions", "replay")
