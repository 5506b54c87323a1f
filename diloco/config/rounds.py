"""The run config's sections about how the hub runs a run's rounds, one pydantic model
each: when a round closes (``[rounds]``), how a version's loss is measured (``[eval]``),
how a round's contributions are combined and judged (``[aggregation]``), audited
(``[audit]``), and what the server keeps of them (``[retention]``), with their bounds and
defaults. The other sections, and the bounds these share, are ``diloco.config.sections``;
``diloco.config`` assembles them all into the ``RunConfig``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from diloco.config.sections import MAX_TIMEOUT_S, MIN_TIMEOUT_S, _Section


class RoundsSection(_Section):
    # fewest accepted contributions that may close a round; 10,000 is past what one server
    # merges in a round (a count stored as a Postgres integer either way)
    quorum: int = Field(2, ge=1, le=10_000)
    target: int | None = Field(None, ge=1, le=10_000)  # close at once at this many (None: no)
    # round deadline, from its opening: at least a second (no volunteer can train and upload
    # in less), at most a week (now + timeout stays a datetime; no round waits longer)
    timeout_s: float = Field(600.0, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
    max_rounds: int = Field(100, ge=1, le=1_000_000)  # round indices are Postgres integers
    # late work: a contribution trained from up to this many versions back that arrives
    # after its round closed is merged into the open round, its weight divided by
    # (1 + staleness) (diloco.protocol.late); 0 refuses late work. Past 10 versions a
    # contribution would weigh under a tenth of a fresh one: not worth the upload
    max_staleness: int = Field(1, ge=0, le=10)
    # a round past its deadline below quorum is extended by timeout_s, at most this many
    # times; then it waits for quorum, unextended. None: extend for ever
    max_extensions: int | None = Field(None, ge=0, le=1_000_000)
    # volunteers heartbeat this often (their lease says so); the client never heartbeats
    # more often than once a second. The hub may ask for less often (an operator limit)
    heartbeat_interval_s: float = Field(10.0, ge=1.0, le=3600.0)
    # a lease lapses this long after its last heartbeat (its holder is taken for gone and
    # its work no longer awaited): longer than a heartbeat interval, or every lease lapses
    lease_ttl_s: float = Field(30.0, ge=1.0, le=86400.0)

    @model_validator(mode="after")
    def _target_not_below_quorum(self) -> RoundsSection:
        if self.target is not None and self.target < self.quorum:
            raise ValueError(
                f"target: target ({self.target}) must be at least quorum ({self.quorum})"
            )
        if self.lease_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"lease_ttl_s: lease_ttl_s ({self.lease_ttl_s:g}) must be longer than "
                f"heartbeat_interval_s ({self.heartbeat_interval_s:g}), or every lease lapses "
                "between two heartbeats"
            )
        return self


class EvalSection(_Section):
    """How a version's eval loss is measured (the server's, after each close, and the
    guard's before publishing a step it judges)."""

    # validation windows of block_size + 1 tokens scored per version (fewer when the
    # validation data holds fewer). The hub may cap it (an operator limit)
    windows: int = Field(64, ge=1, le=1 << 20)


class AggregationSection(_Section):
    """How a round's contributions are combined; robust by default (``diloco.outer.robust``)."""

    # mean: the token-weighted mean as it is. clipped_mean: each contribution's norm is
    # first clipped to clip_multiple times the reference norm. centered_clip: the clipped
    # mean is the centre, and each contribution's distance from it is clipped to the
    # median distance (one CenteredClip step): bounds a direction as well as a length.
    method: Literal["mean", "clipped_mean", "centered_clip"] = "clipped_mean"
    clip_multiple: float = Field(1.0, ge=1.0, le=100.0)
    # the reference norm is the median of the round's norms; a round with fewer
    # contributions than this adds the norms of the run's last `history` aggregated ones
    reference_min: int = Field(3, ge=1, le=1000)
    history: int = Field(32, ge=0, le=10_000)
    # clipped_mean rounds are summed as their uploads arrive (diloco.outer.fold): once the
    # run has reference_min aggregated norms, a round clips against clip_multiple times the
    # median of the last `history` of them, fixed when it opens, rather than against its own
    # median; checks' dot products are then taken on the round's sample. false: every round
    # clips against its own median and the close reads every upload
    fold: bool = True
    # the guard: every step is evaluated before it is published, on the first
    # judge_windows eval windows of the validation data (the same tokens each time, so the
    # base and the step are compared alike; the full eval of a published version comes
    # after it). A step whose loss there passes the base version's x max_loss_ratio (or
    # that is not finite) is never published; the round tries again without the
    # contribution farthest from the aggregate. A first Nesterov step
    # (first_round = "nesterov") can raise the loss by half: keep room. judge_windows 0:
    # steps are published unjudged (only a non-finite one is caught)
    max_loss_ratio: float = Field(2.0, ge=1.0, le=1000.0)
    judge_windows: int = Field(8, ge=0, le=4096)
    # scoring by the loss (diloco.outer.scoring): each scored upload applied alone to the
    # base, measured on score_windows windows of its lease's data (drawn across its inner
    # steps by the round's secret: scoring.lease_picks) and of the validation data; one
    # that raises both losses is left out (no_gain).
    # Every upload of a round of up to 8, half of a larger one. 0: no scoring
    score_windows: int = Field(8, ge=0, le=256)
    # no longer read: every step is judged (judge_windows). Accepted so that run configs
    # written when only a step this many times longer than the round's median was judged
    # still load
    suspect_multiple: float = Field(1.5, ge=1.0, le=1000.0)


class AuditSection(_Section):
    """Audits by replay (docs/verification.md): a share of the uploads is re-run by a
    verifier from the same base, data, seeds and starting AdamW state."""

    # the share of uploads audited, drawn with the round's secret after each upload (a
    # volunteer cannot know beforehand); its blob is kept past retention until the audit is
    # decided (for good if it failed), and so is its revealed starting state. 0: none
    fraction: float = Field(0.05, ge=0.0, le=1.0)
    # an account that has not yet earned its full weight (diloco.protocol.reputation) is
    # audited with a probability of at least 1 - its standing: 8 in 9 for a new account's
    # uploads, falling as its verified work grows, so that a freeloader's account is
    # replayed in its first rounds. Ignored with fraction 0 (no audits at all)
    newcomers: bool = True
    # how long an audited volunteer has to send the AdamW state its lease began from;
    # an audit still waiting then fails
    reveal_s: float = Field(3600.0, ge=10.0, le=7 * 24 * 3600.0)
    # credit waits for an audit (diloco.protocol.audit.settle): what a step credits a
    # contributor's auditable work stays pending until the next decided audit of its work in
    # the run at or after that round; a passed one confirms it, a failed one forfeits it.
    # Totals and the leaderboard count confirmed credit. false: credit is confirmed at the
    # close, as when nothing is audited (fraction 0)
    escrow: bool = True
    # each close audits the round's least aligned upload (diloco.protocol.audit.suspect)
    # besides the draw's, so that stale work of a trusted account is replayed soon, or, when
    # none points away, the scored upload least aligned with its own lease's data (work on
    # other data: bench/own_alignment.py; most rounds name one, at most one replay a round);
    # the volunteer reveals its starting state after its next upload. Ignored with fraction 0
    suspects: bool = True


MAX_GRACE_S = 366 * 24 * 3600.0  # a year: past it, say "keep for ever" (None) instead
DEFAULT_GRACE_S = 24 * 3600.0


class RetentionSection(_Section):
    """What the server deletes of a run as it goes (``server.upkeep.retention``); rows stay."""

    # keep the files of the newest keep_last versions; 0: keep every version. The latest
    # version and an open round's base are kept whatever this says
    keep_last: int = Field(0, ge=0, le=1_000_000)
    # and of every version v with v % milestone_every == 0 (version 0 included); 0: none
    milestone_every: int = Field(0, ge=0, le=1_000_000)
    # a contribution's blob is deleted this long after its round closed (its row, hashes
    # and norm stay: the ledger can still be checked). A day by default: long enough for
    # an operator to look into a round that went wrong before its inputs are gone, short
    # enough that a public run's bucket holds a day of uploads rather than all of them.
    # None: keep the blobs for ever
    contribution_grace_s: float | None = Field(DEFAULT_GRACE_S, ge=0.0, le=MAX_GRACE_S)
