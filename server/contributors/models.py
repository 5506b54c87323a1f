from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Integer, String, Text, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from server.db import Base


class Contributor(Base):
    __tablename__ = "contributors"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    # sha256 hex of the bearer token: tokens are 256-bit random, so a plain digest is enough
    # (no salt or slow hash needed) and lets a request find its contributor by index
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # the last join, heartbeat, upload, lease release or profile update; None: never active
    last_seen_at: Mapped[datetime | None] = mapped_column(default=None)
    # what the volunteer client reports about its machine (contributors.schemas.Hardware)
    hardware: Mapped[dict[str, Any] | None] = mapped_column(JSONB, default=None)
    # set by an admin (POST /contributors/{id}/ban): the token is refused with 403 banned
    # while set, and the contributor's work in rounds not yet closed was excluded
    banned_at: Mapped[datetime | None] = mapped_column(default=None)
    ban_reason: Mapped[str | None] = mapped_column(Text, default=None)
    # quarantined (diloco.protocol.reputation): its uploads are stored, never aggregated or
    # credited, until an admin lifts it
    quarantined_at: Mapped[datetime | None] = mapped_column(default=None)
    quarantine_reason: Mapped[str | None] = mapped_column(Text, default=None)


class ContributorRole(Base):
    """A role the admin granted an account (``POST /contributors/{id}/roles``, the roles of
    ``diloco.protocol.roles``): ``verifier`` may claim and decide audits (``server.audits``);
    ``owner`` may create runs and manage its own (``server.accounts``)."""

    __tablename__ = "contributor_roles"
    __table_args__ = (CheckConstraint("role IN ('verifier', 'owner')", name="role_valid"),)

    contributor_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("contributors.id", ondelete="CASCADE"), primary_key=True
    )
    role: Mapped[str] = mapped_column(String(16), primary_key=True)
    granted_at: Mapped[datetime] = mapped_column()


class OwnerQuota(Base):
    """What the admin lets one run owner's runs cost the hub (``PUT
    /contributors/{id}/quota``); a None field takes the hub's default
    (``server.settings``: ``DILOCO_OWNER_RUNS``, ``_PARAMS``, ``_DATA_BYTES``)."""

    __tablename__ = "owner_quotas"
    __table_args__ = (
        CheckConstraint("runs >= 0", name="runs_non_negative"),
        CheckConstraint("params >= 0", name="params_non_negative"),
        CheckConstraint("data_bytes >= 0", name="data_bytes_non_negative"),
    )

    contributor_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("contributors.id", ondelete="CASCADE"), primary_key=True
    )
    runs: Mapped[int | None] = mapped_column(Integer, default=None)  # not ended, at once
    params: Mapped[int | None] = mapped_column(BigInteger, default=None)  # per run's model
    data_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)  # per run's data
    set_at: Mapped[datetime] = mapped_column()
