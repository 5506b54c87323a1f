"""Prepared datasets (``diloco.data.manifest``) and the units leases hand out of them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from server.db import Base


class Dataset(Base):
    """A dataset's manifest; its files live in storage under ``datasets/<id>/``. The id is
    the manifest's hash, so the same dataset uploaded twice is one row and one set of files."""

    __tablename__ = "datasets"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    manifest: Mapped[dict[str, Any]] = mapped_column(JSONB)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    completed_at: Mapped[datetime | None] = mapped_column(default=None)  # every file stored


class DataUnit(Base):
    """``tokens`` consecutive tokens of one shard of a dataset run: what one lease trains
    on. ``issued`` counts the leases that took it, ``trained`` the accepted contributions
    that covered it; a new lease takes the unit least trained on, then least issued, then
    first in the run's shuffled order (``position``)."""

    __tablename__ = "data_units"
    __table_args__ = (Index("ix_data_units_next", "run_id", "trained", "issued", "position"),)

    run_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    unit: Mapped[int] = mapped_column(Integer, primary_key=True)
    shard: Mapped[int] = mapped_column(Integer)
    start: Mapped[int] = mapped_column(BigInteger)
    tokens: Mapped[int] = mapped_column(Integer)
    position: Mapped[int] = mapped_column(Integer)
    issued: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    trained: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    tokens_trained: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    last_issued_at: Mapped[datetime | None] = mapped_column(default=None)
