from __future__ import annotations

import secrets
from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from diloco.protocol.late import late_weight
from diloco.protocol.reputation import counted_weight
from server.db import Base


class Round(Base):
    """Round ``index`` trains from checkpoint ``index - 1`` and produces checkpoint ``index``.
    ``state`` follows diloco.protocol.state.RoundState; the rules are diloco.protocol.rules.

    While ``closing``, a worker holds the round's claim (``claim_token`` until
    ``claim_expires_at``, renewed while it computes); another worker takes an expired claim
    over. A failed close is recorded in ``error_code``/``error`` and tried again at
    ``retry_at``; ``close_attempts`` counts the claims taken."""

    __tablename__ = "rounds"
    __table_args__ = (
        CheckConstraint("state IN ('open', 'closing', 'closed')", name="state_valid"),
        CheckConstraint("index >= 1", name="index_positive"),
        # the sweeper's scan: rounds not yet closed
        Index("ix_rounds_unfinished", "state", postgresql_where=text("state <> 'closed'")),
    )

    run_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default="open")
    base_version: Mapped[int] = mapped_column(Integer)
    opened_at: Mapped[datetime] = mapped_column()
    deadline: Mapped[datetime] = mapped_column()
    extensions: Mapped[int] = mapped_column(Integer, default=0)
    closed_at: Mapped[datetime | None] = mapped_column(default=None)
    close_code: Mapped[str | None] = mapped_column(String(32), default=None)
    close_reason: Mapped[str | None] = mapped_column(Text, default=None)
    accepted: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    train_loss: Mapped[float | None] = mapped_column(Float, default=None)
    eval_loss: Mapped[float | None] = mapped_column(Float, default=None)
    update_norm: Mapped[float | None] = mapped_column(Float, default=None)
    leases_issued: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    claim_token: Mapped[str | None] = mapped_column(String(32), default=None)
    claim_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    close_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    retry_at: Mapped[datetime | None] = mapped_column(default=None)
    error_code: Mapped[str | None] = mapped_column(String(32), default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    error_at: Mapped[datetime | None] = mapped_column(default=None)
    # the close's checks (diloco.outer.checks): where it samples the uploads, drawn when the
    # round opens and never shown to anyone; and, once published, its change θ_v − θ_{v−1}
    # at those coordinates (float32, little-endian), kept for the next RECENT_CHANGES closes
    check_seed: Mapped[int] = mapped_column(BigInteger, default=lambda: secrets.randbits(62))
    change_sample: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)


class Lease(Base):
    """A contributor's claim on a round; live while ``expires_at`` is in the future."""

    __tablename__ = "leases"
    __table_args__ = (
        UniqueConstraint("run_id", "round_index", "contributor_id"),
        ForeignKeyConstraint(
            ["run_id", "round_index"], ["rounds.run_id", "rounds.index"], ondelete="CASCADE"
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(32))
    round_index: Mapped[int] = mapped_column(Integer)
    contributor_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("contributors.id", ondelete="CASCADE"), index=True
    )
    shard: Mapped[int] = mapped_column(Integer)
    unit: Mapped[int | None] = mapped_column(Integer, default=None)  # data_units.unit (datasets)
    seed: Mapped[int] = mapped_column(BigInteger)
    issued_at: Mapped[datetime] = mapped_column(server_default=func.now())
    last_heartbeat: Mapped[datetime] = mapped_column()
    expires_at: Mapped[datetime] = mapped_column()
    last_step: Mapped[int | None] = mapped_column(Integer, default=None)
    last_loss: Mapped[float | None] = mapped_column(Float, default=None)
    # H for this lease, sized to the volunteer's speed (diloco.protocol.sizing); it caps the
    # contribution's weight. None: a lease issued before sizing, which had the run's steps
    inner_steps: Mapped[int | None] = mapped_column(Integer, default=None)


class Contribution(Base):
    """An accepted upload: its blob is fsynced before this row is committed (invariant 1).
    Its credit is the training FLOPs it put into an outer step: tokens x 6 x n_params.

    ``round_index`` is the round it was trained for (its lease's); ``merged_into_round``
    the round whose outer step takes it: the same, or for late work (its round had closed
    when it arrived: ``diloco.protocol.late``) the round open then, ``staleness`` rounds
    on. So a contributor may have a late contribution for round r merged into r + 1 and
    its own for r + 1, one row per round it trained for."""

    __tablename__ = "contributions"
    __table_args__ = (
        UniqueConstraint("run_id", "round_index", "contributor_id"),
        ForeignKeyConstraint(
            ["run_id", "round_index"], ["rounds.run_id", "rounds.index"], ondelete="CASCADE"
        ),
        ForeignKeyConstraint(
            ["run_id", "merged_into_round"], ["rounds.run_id", "rounds.index"], ondelete="CASCADE"
        ),
        CheckConstraint(
            "credit_status IN ('confirmed', 'pending', 'forfeited')", name="credit_status_valid"
        ),
        # what the arrival scorer looks for (server.rounds.arrival_scores)
        Index(
            "ix_contributions_unscored",
            "created_at",
            postgresql_where=text("score IS NULL AND aggregated_at IS NULL"),
        ),
        # a contributor's own contributions, newest first (GET /contributors/me)
        Index("ix_contributions_contributor_id_created_at", "contributor_id", "created_at"),
        # the same tensors twice in a round are a replay (protocol.rules.admit_payload)
        Index(
            "ix_contributions_run_id_round_index_payload_sha256",
            "run_id",
            "round_index",
            "payload_sha256",
            unique=True,
        ),
        # a step's contributions (the close reads them), and no replay within a step either
        Index(
            "ix_contributions_run_id_merged_into_round_payload_sha256",
            "run_id",
            "merged_into_round",
            "payload_sha256",
            unique=True,
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(32))
    round_index: Mapped[int] = mapped_column(Integer)
    merged_into_round: Mapped[int] = mapped_column(Integer)  # round_index unless late
    staleness: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    contributor_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("contributors.id", ondelete="CASCADE")
    )
    lease_id: Mapped[str] = mapped_column(String(32), ForeignKey("leases.id", ondelete="CASCADE"))
    base_version: Mapped[int] = mapped_column(Integer)
    tokens: Mapped[int] = mapped_column(BigInteger)
    inner_steps: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float] = mapped_column(Float)
    nbytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    blob_key: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # set in the transaction that closes the round with this contribution in its outer step;
    # a contribution whose round never closes keeps None and earns no credit
    aggregated_at: Mapped[datetime | None] = mapped_column(default=None)
    credit: Mapped[float] = mapped_column(Float, default=0.0, server_default=text("0"))  # FLOPs
    # confirmed (counted in totals), pending (waiting for an audit of its contributor's work
    # in the run) or forfeited (one failed first; credit 0): diloco.protocol.audit.settle
    credit_status: Mapped[str] = mapped_column(
        String(16), default="confirmed", server_default=text("'confirmed'")
    )
    # left out of its round's step (e.g. its stored blob could not be read), or found by an
    # audit, after its step took it, not to be the work it claims (code "replay"): earns
    # nothing
    excluded_code: Mapped[str | None] = mapped_column(String(32), default=None)
    excluded_reason: Mapped[str | None] = mapped_column(Text, default=None)
    # measured by the server when it was accepted (diloco.outer.inspection.UploadInspector)
    # tokens it was worth when accepted (its claim, at most its lease's); what it counts for
    # in its step and in credit is counted_weight: discounted by staleness, times standing
    weight: Mapped[int | None] = mapped_column(BigInteger, default=None)
    norm: Mapped[float | None] = mapped_column(Float, default=None)  # ‖Δ‖ as decoded
    payload_sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    # what the round's step made of it (diloco.outer.robust.Share), set when the step is published
    cosine: Mapped[float | None] = mapped_column(Float, default=None)  # to the aggregate
    clip_factor: Mapped[float | None] = mapped_column(Float, default=None)
    # what the close's checks measured of it (diloco.outer.checks.Check.figures); a failed
    # check's code and reason are also its excluded_code and excluded_reason
    checks: Mapped[dict | None] = mapped_column(JSON, default=None)
    # its score by the loss (diloco.outer.scoring.Score.figures), taken on arrival off the
    # close's critical path (server.rounds.arrival_scores); {}: not scored on arrival (no
    # lease data, late work, scoring off); None: not yet. A scorer holds it until
    # score_claim_expires_at
    score: Mapped[dict | None] = mapped_column(JSON, default=None)
    score_claim_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    # how it was trained beyond its lease (diloco.wire.header.ReplayRecord: the digest of
    # the AdamW state it began from, precision, micro-batch): what an audit replays
    replay: Mapped[dict | None] = mapped_column(JSON, default=None)
    # its contributor's standing when it was accepted (diloco.protocol.reputation): the
    # share of its weight it counts for. None: a row from before standings (all of it)
    standing: Mapped[float | None] = mapped_column(Float, default=None)
    # retention (server.upkeep.retention) deleted the blob once its round was closed and the run's
    # grace had passed; the row (sha256, nbytes, norm, payload_sha256) stays. Set before
    # the blob goes
    blob_deleted_at: Mapped[datetime | None] = mapped_column(default=None)

    @property
    def excluded(self) -> str | None:
        """Why its round's close left it out, as the API says it (``code: reason``)."""
        return (
            None if self.excluded_code is None else f"{self.excluded_code}: {self.excluded_reason}"
        )

    @property
    def discounted_weight(self) -> int:
        """Its weight when accepted (rows from before weights were measured: their claim),
        discounted by its staleness: the tokens its round counts for it."""
        return late_weight(self.tokens if self.weight is None else self.weight, self.staleness)

    @property
    def earned(self) -> float:
        """Its contributor's standing when it was accepted (rows from before: 1)."""
        return 1.0 if self.standing is None else self.standing

    @property
    def counted_weight(self) -> int:
        """The tokens it counts for in its step and in credit: ``discounted_weight`` times
        its contributor's standing then, rounded up (``reputation.counted_weight``)."""
        weight = self.tokens if self.weight is None else self.weight
        return counted_weight(weight, self.staleness, self.earned)


class UploadRejection(Base):
    """A refused upload, for the dashboard: who, which round, the error code and sentence.
    A log beside the run's state, not part of it (invariant 4): nothing reads it to train,
    close rounds or give credit, and it is pruned to the newest ``rejections.KEEP`` per run."""

    __tablename__ = "upload_rejections"
    __table_args__ = (Index("ix_upload_rejections_run_id_round_index", "run_id", "round_index"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(32), ForeignKey("runs.id", ondelete="CASCADE"))
    round_index: Mapped[int] = mapped_column(Integer)  # as the URL named it: may not exist
    contributor_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("contributors.id", ondelete="CASCADE")
    )
    code: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column()


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
