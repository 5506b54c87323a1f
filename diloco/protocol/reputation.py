"""When a contributor's work keeps failing verification, it is quarantined (issue 26).

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

from collections.abc import Sequence

# the exclusion codes that say the work was not there (diloco.outer.checks, .scoring)
# and an audit that found the work was not what it claims (diloco.protocol.audit)
VERIFY_CODES = frozenset({"zero_update", "copy", "opposed", "unaligned", "no_gain", "replay"})
WINDOW = 5
FAILS = 3
CODE = "quarantined"  # the exclusion code of a quarantined contributor's work


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
