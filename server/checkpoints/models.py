from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    func,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from server.db import Base


class Checkpoint(Base):
    """A published global model version. Its files: the parameters (what volunteers
    download; ``sha256`` is its ETag), the outer state (Nesterov momentum and the delta
    residual: what a restarted server continues from) and, from version 1, the int8 delta
    from the version before (what a returning volunteer downloads instead).

    A close publishes the version once its delta is durable; the parameters and the outer
    state (its full files) follow, off the close's critical path
    (``server.rounds.full_files``): ``full_files_at`` is NULL until they are durable."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        Index(
            "ix_checkpoints_eval_pending", "created_at", postgresql_where=text("eval_loss IS NULL")
        ),
        Index(
            "ix_checkpoints_full_pending",
            "created_at",
            postgresql_where=text("full_files_at IS NULL"),
        ),
    )

    run_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    params_key: Mapped[str] = mapped_column(Text)
    state_key: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    nbytes: Mapped[int] = mapped_column(BigInteger)
    eval_loss: Mapped[float | None] = mapped_column(Float, default=None)  # None: pending
    # the int8 delta from version - 1 (diloco.wire.delta); None for version 0
    delta_key: Mapped[str | None] = mapped_column(Text, default=None)
    delta_sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    delta_nbytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # the process evaluating this version holds it until then (server.rounds.version_eval)
    eval_claim_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # retention (server.upkeep.retention) deleted its three files; the row stays, its downloads
    # answer 410 gone. Set before the files go
    files_deleted_at: Mapped[datetime | None] = mapped_column(default=None)
    # when the parameters and the outer state became durable; None: pending (the delta is
    # published, they are being committed or rebuilt: server.rounds.full_files)
    full_files_at: Mapped[datetime | None] = mapped_column(default=None)
    # the process committing or rebuilding them holds the version until then
    full_claim_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    # what a rebuild of them needs besides the run's config and the base version
    # (server.rounds.full_files.Recipe); None for version 0
    rebuild: Mapped[dict | None] = mapped_column(JSON(none_as_null=True), default=None)
