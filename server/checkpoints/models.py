from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Float, ForeignKey, Integer, String, Text, func
from sqlalchemy.orm import Mapped, mapped_column

from server.db import Base


class Checkpoint(Base):
    """A published global model version. Two files: the parameters alone (what volunteers
    download; ``sha256`` is its ETag) and the full state with the outer momentum (what a
    restarted server continues from)."""

    __tablename__ = "checkpoints"

    run_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    params_key: Mapped[str] = mapped_column(Text)
    state_key: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    nbytes: Mapped[int] = mapped_column(BigInteger)
    eval_loss: Mapped[float | None] = mapped_column(Float, default=None)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
