"""initial schema: runs, contributors, rounds, leases, contributions, checkpoints

Revision ID: 0001
Revises:
Create Date: 2026-11-22 02:32:11.740735
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "contributors",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_contributors")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_contributors_token_hash")),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("config", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("n_params", sa.BigInteger(), nullable=False),
        sa.Column("n_shards", sa.Integer(), nullable=False),
        sa.Column("chunk_len", sa.Integer(), nullable=False),
        sa.Column("train_tokens", sa.BigInteger(), nullable=False),
        sa.Column("val_tokens", sa.BigInteger(), nullable=False),
        sa.Column("shards", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("checkpoint_version", sa.Integer(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "status IN ('active', 'paused', 'completed', 'cancelled')",
            name=op.f("ck_runs_status_valid"),
        ),
        sa.CheckConstraint("checkpoint_version >= 0", name=op.f("ck_runs_version_non_negative")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_table(
        "checkpoints",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("params_key", sa.Text(), nullable=False),
        sa.Column("state_key", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("eval_loss", sa.Float(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "version", name=op.f("pk_checkpoints")),
    )
    op.create_table(
        "rounds",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("base_version", sa.Integer(), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deadline", sa.DateTime(timezone=True), nullable=False),
        sa.Column("extensions", sa.Integer(), nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("close_code", sa.String(length=32), nullable=True),
        sa.Column("close_reason", sa.Text(), nullable=True),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("train_loss", sa.Float(), nullable=True),
        sa.Column("eval_loss", sa.Float(), nullable=True),
        sa.Column("update_norm", sa.Float(), nullable=True),
        sa.CheckConstraint(
            "state IN ('open', 'closing', 'closed')", name=op.f("ck_rounds_state_valid")
        ),
        sa.CheckConstraint("index >= 1", name=op.f("ck_rounds_index_positive")),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_rounds_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "index", name=op.f("pk_rounds")),
    )
    op.create_table(
        "leases",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("round_index", sa.Integer(), nullable=False),
        sa.Column("contributor_id", sa.String(length=32), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column(
            "issued_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_step", sa.Integer(), nullable=True),
        sa.Column("last_loss", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["contributor_id"],
            ["contributors.id"],
            name=op.f("fk_leases_contributor_id_contributors"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "round_index"],
            ["rounds.run_id", "rounds.index"],
            name=op.f("fk_leases_run_id_round_index_rounds"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_leases")),
        sa.UniqueConstraint(
            "run_id",
            "round_index",
            "contributor_id",
            name=op.f("uq_leases_run_id_round_index_contributor_id"),
        ),
    )
    op.create_index(op.f("ix_leases_contributor_id"), "leases", ["contributor_id"], unique=False)
    op.create_table(
        "contributions",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("round_index", sa.Integer(), nullable=False),
        sa.Column("contributor_id", sa.String(length=32), nullable=False),
        sa.Column("lease_id", sa.String(length=32), nullable=False),
        sa.Column("base_version", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("inner_steps", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("blob_key", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["contributor_id"],
            ["contributors.id"],
            name=op.f("fk_contributions_contributor_id_contributors"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["lease_id"],
            ["leases.id"],
            name=op.f("fk_contributions_lease_id_leases"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "round_index"],
            ["rounds.run_id", "rounds.index"],
            name=op.f("fk_contributions_run_id_round_index_rounds"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_contributions")),
        sa.UniqueConstraint(
            "run_id",
            "round_index",
            "contributor_id",
            name=op.f("uq_contributions_run_id_round_index_contributor_id"),
        ),
    )
    op.create_index(
        op.f("ix_contributions_contributor_id"), "contributions", ["contributor_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_contributions_contributor_id"), table_name="contributions")
    op.drop_table("contributions")
    op.drop_index(op.f("ix_leases_contributor_id"), table_name="leases")
    op.drop_table("leases")
    op.drop_table("rounds")
    op.drop_table("checkpoints")
    op.drop_table("runs")
    op.drop_table("contributors")
