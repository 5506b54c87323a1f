from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import CheckConstraint, Float, ForeignKey, Integer, String, Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from server.db import Base


class Webhook(Base):
    """A URL that gets the events of one run (``run_id``), or of every run (None: the
    hub's admin set it)."""

    __tablename__ = "webhooks"
    __table_args__ = (
        CheckConstraint("format IN ('json', 'slack', 'discord')", name="format_valid"),
        CheckConstraint("eval_rise > 1", name="eval_rise_above_one"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str | None] = mapped_column(
        String(32), ForeignKey("runs.id", ondelete="CASCADE"), default=None, index=True
    )
    url: Mapped[str] = mapped_column(Text)
    format: Mapped[str] = mapped_column(String(8))
    events: Mapped[list[str]] = mapped_column(JSONB)
    # the HMAC-SHA256 key the bodies are signed with: shown once, kept to sign
    secret: Mapped[str] = mapped_column(String(64))
    eval_rise: Mapped[float] = mapped_column(Float)  # eval.rising: past this x the best
    created_by: Mapped[str] = mapped_column(String(32))  # "admin" or the owner's id
    created_at: Mapped[datetime] = mapped_column()


class WebhookDelivery(Base):
    """One event for one webhook: sent until a 2xx answers, or given up after the last
    attempt. ``next_at`` is when it is due (a sender holds it by moving it ahead)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (CheckConstraint("attempts >= 0", name="attempts_non_negative"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    webhook_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("webhooks.id", ondelete="CASCADE"), index=True
    )
    event: Mapped[str] = mapped_column(String(32))
    body: Mapped[dict[str, Any]] = mapped_column(JSONB)  # as sent (the format's shape)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_at: Mapped[datetime | None] = mapped_column(index=True)  # None: done
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)
    status: Mapped[int | None] = mapped_column(Integer, default=None)  # the last answer's
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column()
