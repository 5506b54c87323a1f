from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Integer, String, Text, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from diloco.protocol.state import RunStatus
from server.db import Base

__all__ = ["Run", "RunBan", "RunMember", "RunStatus"]


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(
            "status IN ('active', 'paused', 'completed', 'cancelled')", name="status_valid"
        ),
        CheckConstraint("checkpoint_version >= 0", name="version_non_negative"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.ACTIVE)
    config: Mapped[dict[str, Any]] = mapped_column(JSONB)
    seed: Mapped[int] = mapped_column(BigInteger)
    n_params: Mapped[int] = mapped_column(BigInteger)
    n_shards: Mapped[int] = mapped_column(Integer)
    chunk_len: Mapped[int] = mapped_column(Integer)
    train_tokens: Mapped[int] = mapped_column(BigInteger)
    val_tokens: Mapped[int] = mapped_column(BigInteger)
    shards: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)  # [{"sha256", "nbytes"}] by index
    checkpoint_version: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(server_default=func.now(), onupdate=func.now())
    # sha256 of the invite code: while set, the run is private (joining needs membership,
    # RunMember, which the code grants); None: anyone may join
    invite_hash: Mapped[str | None] = mapped_column(String(64), default=None)
    # a run on a prepared dataset: its id (files under datasets/<id>/) and token dtype; a
    # text-file run keeps its own uint8 shards under runs/<id>/data/
    dataset_id: Mapped[str | None] = mapped_column(
        String(32), ForeignKey("datasets.id", ondelete="RESTRICT"), default=None
    )
    token_dtype: Mapped[str] = mapped_column(
        String(8), default="uint8", server_default=text("'uint8'")
    )
    # the run owner who created it (server.accounts); None: the admin did, or the owner's
    # account is gone. Owners manage their own runs; the admin manages every run
    owner_id: Mapped[str | None] = mapped_column(
        String(32), ForeignKey("contributors.id", ondelete="SET NULL"), default=None, index=True
    )


class RunMember(Base):
    """A contributor admitted to a private run with its invite code (kept when the code is
    replaced: a new code is for newcomers)."""

    __tablename__ = "run_members"

    run_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    contributor_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("contributors.id", ondelete="CASCADE"), primary_key=True, index=True
    )
    joined_at: Mapped[datetime] = mapped_column()


class RunBan(Base):
    """A contributor its owner (or the admin) banned from one run: its joins and uploads on
    the run are refused (403 ``banned_from_run``); the rest of the hub still takes it."""

    __tablename__ = "run_bans"

    run_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    contributor_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("contributors.id", ondelete="CASCADE"), primary_key=True, index=True
    )
    reason: Mapped[str] = mapped_column(Text)
    banned_by: Mapped[str] = mapped_column(String(32))  # "admin" or the owner's id
    banned_at: Mapped[datetime] = mapped_column()
