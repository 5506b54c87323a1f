"""A contributor's standing, and quarantine when its work keeps failing verification
(issue 26).

Standing: what share of its work's weight an account's upload counts for, in the step and
in credit. A new account's work counts for 1/(EARNED_AT + 1) of its tokens; each of its
contributions a step took and no verification failed adds a share, each one verification
failed takes two away, up to the whole (``standing``). So an account earns its weight by
work that was checked, and a banned volunteer that registers again starts from little.
Weights are relative within a step: a round of equally new accounts averages as before.

One failed check or score costs that contribution its credit and its weight
(``diloco.outer.checks``, ``diloco.outer.scoring``); honest work fails one now and then
(a noisy score late in a run). Work that fails again and again is no accident: a
contributor with ``FAILS`` or more of its latest ``WINDOW`` judged contributions left out by
verification is quarantined. Its uploads are still taken and stored, but none is
aggregated or credited until an admin lifts the quarantine; it is told why. What the
guard blames or a damaged blob does not count: the guard blames the farthest upload of a
failing step, not necessarily a bad one, and a damaged blob is the server's loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from diloco.protocol.late import late_weight

# the exclusion codes that say the work was not there (diloco.outer.checks, .scoring)
# and an audit that found the work was not what it claims (diloco.protocol.audit)
VERIFY_CODES = frozenset({"zero_update", "copy", "opposed", "unaligned", "no_gain", "replay"})
WINDOW = 5
FAILS = 3
CODE = "quarantined"  # the exclusion code of a quarantined contributor's work
EARNED_AT = 8  # verified contributions after which an account's work counts in full


def standing(verified: int, failed: int) -> float:
    """The share of its work's weight an account counts for, from its contributions that a
    step took and no verification failed (``verified``) and those verification left out
    (``failed``, codes ``VERIFY_CODES``): (1 + verified − 2·failed) / (1 + EARNED_AT),
    at least one share, at most 1."""
    shares = max(1, 1 + verified - 2 * failed)
    return min(1.0, shares / (1 + EARNED_AT))


def counted_weight(weight: int, staleness: int, standing_: float = 1.0) -> int:
    """What an accepted upload counts for in its step and in credit: its weight when
    accepted, discounted by its staleness (``late_weight``), times its contributor's
    standing then, rounded up."""
    return math.ceil(late_weight(weight, staleness) * standing_)


def quarantine_reason(recent: Sequence[str | None]) -> str | None:
    """Why a contributor is quarantined, or None. ``recent``: its latest judged
    contributions' exclusion codes, newest first (None: aggregated)."""
    window = list(recent[:WINDOW])
    failed = [code for code in window if code in VERIFY_CODES]
    if len(failed) < FAILS:
        return None
    counts = ", ".join(f"{c} ×{failed.count(c)}" for c in sorted(set(failed)))
    return (
        f"{len(failed)} of its last {len(window)} judged contributions failed verification "
        f"({counts}): its uploads are stored but not aggregated or credited until an admin "
        "lifts the quarantine"
    )
