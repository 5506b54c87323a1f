"""run owners: the owner role, each run's owner, quotas per owner, bans from one run

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ROLE_CHECK = "ck_contributor_roles_role_valid"  # as 0015 named it (op.f: no convention)


def upgrade() -> None:
    op.drop_constraint(op.f(ROLE_CHECK), "contributor_roles", type_="check")
    op.create_check_constraint(
        op.f(ROLE_CHECK), "contributor_roles", "role IN ('verifier', 'owner')"
    )
    op.add_column("runs", sa.Column("owner_id", sa.String(length=32), nullable=True))
    op.create_foreign_key(
        op.f("fk_runs_owner_id_contributors"),
        "runs",
        "contributors",
        ["owner_id"],
        ["id"],
        ondelete="SET NULL",
    )
    op.create_index(op.f("ix_runs_owner_id"), "runs", ["owner_id"])
    op.create_table(
        "owner_quotas",
        sa.Column("contributor_id", sa.String(length=32), nullable=False),
        sa.Column("runs", sa.Integer(), nullable=True),
        sa.Column("params", sa.BigInteger(), nullable=True),
        sa.Column("data_bytes", sa.BigInteger(), nullable=True),
        sa.Column("set_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("runs >= 0", name=op.f("ck_owner_quotas_runs_non_negative")),
        sa.CheckConstraint("params >= 0", name=op.f("ck_owner_quotas_params_non_negative")),
        sa.CheckConstraint("data_bytes >= 0", name=op.f("ck_owner_quotas_data_bytes_non_negative")),
        sa.ForeignKeyConstraint(
            ["contributor_id"],
            ["contributors.id"],
            name=op.f("fk_owner_quotas_contributor_id_contributors"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("contributor_id", name=op.f("pk_owner_quotas")),
    )
    op.create_table(
        "run_bans",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("contributor_id", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("banned_by", sa.String(length=32), nullable=False),
        sa.Column("banned_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_bans_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["contributor_id"],
            ["contributors.id"],
            name=op.f("fk_run_bans_contributor_id_contributors"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "contributor_id", name=op.f("pk_run_bans")),
    )
    op.create_index(op.f("ix_run_bans_contributor_id"), "run_bans", ["contributor_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_run_bans_contributor_id"), table_name="run_bans")
    op.drop_table("run_bans")
    op.drop_table("owner_quotas")
    op.drop_index(op.f("ix_runs_owner_id"), table_name="runs")
    op.drop_constraint(op.f("fk_runs_owner_id_contributors"), "runs", type_="foreignkey")
    op.drop_column("runs", "owner_id")
    op.execute("DELETE FROM contributor_roles WHERE role = 'owner'")
    op.drop_constraint(op.f(ROLE_CHECK), "contributor_roles", type_="check")
    op.create_check_constraint(op.f(ROLE_CHECK), "contributor_roles", "role IN ('verifier')")
