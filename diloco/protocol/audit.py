"""Audits by replay (issue 26, docs/verification.md): the rules, with no clock or database.

Every upload carries a replay record (``diloco.wire.header.ReplayRecord``): the SHA-256 of
the AdamW state file its lease began from (or ``fresh``), its precision and micro-batch.
With its lease (base version, data, seed, steps) and the run's config that is all a
verifier needs to train the lease again, once the volunteer reveals that state. Which
uploads are audited is drawn after each upload from the round's secret ``check_seed``, so
a volunteer cannot know beforehand which of its leases will be replayed: it either trains
every lease honestly or risks each.

An audit passes when the replayed update, encoded by the run's codec as the volunteer's
was, points the same way as the upload (cosine at least ``MIN_COSINE``) and is as long
(``NORM_RATIO``). The same code on the same kind of device and precision reproduces an
upload to within rounding (cosine above 0.9999 on CPU fp32); the tolerance leaves room for
another machine's kernels, not for other work: training on other data, from another base
or for fewer steps moves the cosine far below it (bench/audit.py).

Credit waits for audits (``settle``): what a step credits for auditable work is pending
until an audit of the same contributor in the run decides, at or after that round; so
credit counts verified work, and a freeloader's unaudited leases earn nothing either.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

MIN_COSINE = 0.99
NORM_RATIO = (0.9, 1.1)  # replayed ‖Δ‖ / uploaded ‖Δ‖
CLAIM_S = 1800.0  # a verifier holds a claimed audit this long before another may take it
CODE = "replay"  # the exclusion code of work an audit found was not what it claims
SUSPECT_RATIO = 0.85  # a round's least aligned upload below this share of its median ...
SUSPECT_MIN_ROUND = 3  # ... in a round of at least this many is audited (``suspect``)
# else the scored upload of least own_alignment below this share of the round's median
ALIGNMENT_RATIO = 0.5


class AuditStatus(StrEnum):
    REVEALING = "revealing"  # waiting for the volunteer's starting state
    PENDING = "pending"  # a verifier may claim it
    PASSED = "passed"
    FAILED = "failed"


DECIDED = frozenset({AuditStatus.PASSED, AuditStatus.FAILED})


def audit_share(fraction: float, standing: float, *, newcomers: bool) -> float:
    """The probability that an upload is audited: the run's ``fraction`` (0: never), or,
    with ``newcomers``, at least 1 − its contributor's standing (``reputation.standing``):
    a new account's uploads are replayed far more often than a trusted one's."""
    if fraction <= 0.0:
        return 0.0
    return max(fraction, 1.0 - standing) if newcomers else fraction


def drawn(check_seed: int, contributor_id: str, share: float) -> bool:
    """Whether this contributor's upload to the round with this secret is audited: a
    uniform draw from the secret and the contributor, below ``share``."""
    if share <= 0.0:
        return False
    digest = hashlib.sha256(f"audit:{check_seed}:{contributor_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def suspect(
    median_cosines: Mapping[str, float], alignments: Mapping[str, float] | None = None
) -> str | None:
    """The upload of a closed round that is audited whatever the draw said: the one that
    points least with the others (the lowest cosine to the others' coordinate-wise median
    on the sampled coordinates, ``diloco.outer.checks``), in a round of at least
    ``SUSPECT_MIN_ROUND`` with a common direction (their median is positive), when it is
    below ``SUSPECT_RATIO`` times that median; else, by the same rule with
    ``ALIGNMENT_RATIO``, the scored upload that points least along its own lease windows'
    gradient (``alignments``: ``diloco.outer.scoring``'s ``own_alignment``); else None.

    Why: the random draw finds a trusted account that turns to freeloading only slowly (1 −
    (1 − f)³ within three rounds: 14% at f = 0.05). Work trained from a stale base points
    away from the round's (bench/attacks.py's setting: mostly 0.23–0.87 of its round's
    median, honest work's lowest 0.85–1.0; docs/verification.md), so the round's least aligned
    upload is the one worth a replay; honest work that happens to be it passes and loses
    nothing. Work trained honestly on other data points with the round; what gives it away
    is that its Δ holds no step taken on its lease's scored windows. The alignment's honest
    spread is wide at the demo's size (bench/own_alignment.py: a round of four honest
    uploads and one on other data names the latter in 75% of rounds, 98% within three, and
    a round of five honest ones names one in 70%): a suspect is a replay's cost, not a
    verdict."""
    by_direction = _far_below(median_cosines, SUSPECT_RATIO)
    if by_direction is not None:
        return by_direction
    return _far_below(alignments or {}, ALIGNMENT_RATIO)


def _far_below(figures: Mapping[str, float], ratio: float) -> str | None:
    """The id of the lowest of ``figures`` when there are at least ``SUSPECT_MIN_ROUND``,
    their median is positive and it is below ``ratio`` times that median (ties: the first id)."""
    if len(figures) < SUSPECT_MIN_ROUND:
        return None
    typical = statistics.median(figures.values())
    lowest = min(figures, key=lambda i: (figures[i], i))
    if typical <= 0.0 or figures[lowest] >= ratio * typical:
        return None
    return lowest


class CreditStatus(StrEnum):
    """Where a contribution's credit stands (``settle``)."""

    CONFIRMED = "confirmed"  # counted in totals and on the leaderboard
    PENDING = "pending"  # credited by its step, waiting for an audit of its contributor
    FORFEITED = "forfeited"  # an audit of its contributor failed first: 0


def escrowed(fraction: float, escrow: bool, *, auditable: bool) -> bool:
    """Whether a contribution's credit waits for an audit: in a run that audits
    (``fraction`` > 0) with ``[audit] escrow``, for work an audit can replay (an upload
    with a replay record; steps trained ahead carry none). Anything else is confirmed when
    its step is published: nothing could ever settle it."""
    return fraction > 0.0 and escrow and auditable


def settle(round_index: int, decided: Iterable[tuple[int, datetime, AuditStatus]]) -> CreditStatus:
    """The status of a contributor's escrowed credit for its work of ``round_index``, given
    its decided audits in the run (round, when decided, passed or failed): settled by the
    first audit decided at or after that round, confirmed if it passed, forfeited if it
    failed; pending while there is none.

    Why it is fair: a volunteer that skips the work of a share φ of its leases passes an
    audit, drawn at random from its leases, with probability 1 − φ, and each audit settles
    every lease since the one before: its expected credit is 1 − φ of what it claimed, the
    work it did. A freeloader's audits all fail: it earns nothing, even from the leases
    that were never drawn. An honest volunteer loses nothing, only waits."""
    later = [(when, status) for index, when, status in decided if index >= round_index]
    if not later:
        return CreditStatus.PENDING
    _, first = min(later)
    return CreditStatus.CONFIRMED if first == AuditStatus.PASSED else CreditStatus.FORFEITED


def reveal_deadline(now: datetime, reveal_s: float) -> datetime:
    return now + timedelta(seconds=reveal_s)


def max_state_bytes(n_params: int) -> int:
    """The largest starting-state file a volunteer may reveal for a model of ``n_params``:
    AdamW's two moments and the codec's residual in float32, and a generous header (the
    parameter names and shapes, the param groups)."""
    return 3 * 4 * n_params + (4 << 20)


@dataclass(frozen=True)
class Verdict:
    """What a replay found: the cosine between the replayed and the uploaded update, the
    relative error ‖r − u‖ / ‖u‖ and the norm ratio ‖r‖ / ‖u‖."""

    cosine: float
    rel_error: float
    norm_ratio: float

    @property
    def passed(self) -> bool:
        low, high = NORM_RATIO
        return self.cosine >= MIN_COSINE and low <= self.norm_ratio <= high

    def sentence(self) -> str:
        low, high = NORM_RATIO
        figures = (
            f"cosine {self.cosine:.4f} (at least {MIN_COSINE}), norm ratio "
            f"{self.norm_ratio:.3f} ({low}..{high}), relative error {self.rel_error:.3g}"
        )
        if self.passed:
            return f"the replay reproduces the upload: {figures}"
        return f"the replay does not reproduce the upload: {figures}"
