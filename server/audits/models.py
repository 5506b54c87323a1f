from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from server.db import Base


class Audit(Base):
    """One contribution drawn for an audit by replay (``diloco.protocol.audit``).

    ``revealing``: waiting, until ``reveal_by``, for the volunteer to send the AdamW state
    its lease began from (``state_key`` once it has; a lease that began fresh skips this);
    ``pending``: a verifier may claim it (``claimed_by`` until ``claimed_until``);
    ``passed`` / ``failed``: decided, with the replay's figures and ``detail``. Its
    contribution's blob and its state are kept past retention."""

    __tablename__ = "audits"
    __table_args__ = (
        CheckConstraint(
            "status IN ('revealing', 'pending', 'passed', 'failed')", name="status_valid"
        ),
        ForeignKeyConstraint(
            ["run_id", "round_index"], ["rounds.run_id", "rounds.index"], ondelete="CASCADE"
        ),
        Index("ix_audits_run_id_status", "run_id", "status"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(32))
    round_index: Mapped[int] = mapped_column(Integer)
    contribution_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("contributions.id", ondelete="CASCADE"), unique=True
    )
    contributor_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("contributors.id", ondelete="CASCADE")
    )
    status: Mapped[str] = mapped_column(String(16))
    state_key: Mapped[str | None] = mapped_column(Text, default=None)
    state_nbytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    reveal_by: Mapped[datetime] = mapped_column()
    claimed_by: Mapped[str | None] = mapped_column(String(32), default=None)
    claimed_until: Mapped[datetime | None] = mapped_column(default=None)
    cosine: Mapped[float | None] = mapped_column(Float, default=None)
    rel_error: Mapped[float | None] = mapped_column(Float, default=None)
    norm_ratio: Mapped[float | None] = mapped_column(Float, default=None)
    detail: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column()
    decided_at: Mapped[datetime | None] = mapped_column(default=None)
