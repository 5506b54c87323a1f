"""datasets: prepared datasets, runs on them, and the data units leases hand out

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 00:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "datasets",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("manifest", postgresql.JSONB(), nullable=False),
        sa.Column("total_bytes", sa.BigInteger(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_datasets")),
    )
    op.add_column("runs", sa.Column("dataset_id", sa.String(32), nullable=True))
    op.add_column(
        "runs",
        sa.Column("token_dtype", sa.String(8), server_default=sa.text("'uint8'"), nullable=False),
    )
    op.create_foreign_key(
        op.f("fk_runs_dataset_id_datasets"),
        "runs",
        "datasets",
        ["dataset_id"],
        ["id"],
        ondelete="RESTRICT",
    )
    op.add_column("leases", sa.Column("unit", sa.Integer(), nullable=True))
    op.create_table(
        "data_units",
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("unit", sa.Integer(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("start", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("issued", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("trained", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("tokens_trained", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_issued_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_data_units_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "unit", name=op.f("pk_data_units")),
    )
    op.create_index("ix_data_units_next", "data_units", ["run_id", "trained", "issued", "position"])


def downgrade() -> None:
    op.drop_index("ix_data_units_next", table_name="data_units")
    op.drop_table("data_units")
    op.drop_column("leases", "unit")
    op.drop_constraint(op.f("fk_runs_dataset_id_datasets"), "runs", type_="foreignkey")
    op.drop_column("runs", "token_dtype")
    op.drop_column("runs", "dataset_id")
    op.drop_table("datasets")
