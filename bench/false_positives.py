"""False positives of the close's verification: only honest volunteers, through the
server's own close in the simulator (``diloco simulate``, diloco mode: the cheap checks of
``diloco.outer.checks`` and the scoring of ``diloco.outer.scoring`` in every round), and the
server's quarantine rule (``diloco.protocol.reputation``) applied to each volunteer's
record as the rounds go.

It prints, per round, how many uploads were scored and left out (by code), and the
smallest margins honest work kept: its cosine to the others' median on the sampled
coordinates (the direction checks leave out at or below 4/√s, about 0.03), and the larger
of its two loss gains (the scoring leaves out below −0.5% of the base's loss on both).
Then the goal (issue 26): in 20 rounds of 100 honest volunteers none is ever quarantined.
An honest upload left out once loses that round's credit; the count is printed beside.

    python bench/false_positives.py [--workers 100] [--rounds 20] [--json out.json]
    python bench/false_positives.py --workers 6 --rounds 2     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.attacks import config  # noqa: E402
from tests.support.corpora import TINYSHAKESPEARE  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--data", type=Path, default=TINYSHAKESPEARE)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch

    from diloco.config import parse_config
    from diloco.protocol.reputation import quarantine_reason
    from diloco.simulate.run import SimOptions, simulate

    torch.set_num_threads(1)
    cfg = parse_config(config(args.data, args.rounds, "clipped_mean"))
    print(
        f"{args.workers} honest volunteers, {args.rounds} rounds of H={cfg.inner.steps} on "
        f"{args.data.name}; scoring on {cfg.aggregation.score_windows} windows",
        file=sys.stderr,
    )
    started = time.perf_counter()
    result = simulate(cfg, SimOptions(workers=args.workers, seed=0, eval_windows=args.eval_windows))
    seconds = time.perf_counter() - started
    print(f"\n{'round':>5} {'uploads':>7} {'scored':>6} {'left out':<24} "
          f"{'min cosine':>10} {'min gain':>9} {'eval loss':>9}")  # fmt: skip
    left_out: dict[str, int] = {}
    history: dict[str, list[str | None]] = {}  # each volunteer's codes, newest first
    quarantined: dict[str, int] = {}  # volunteer -> the round it would be quarantined in
    cosines, gains, scored = [], [], 0
    for r in result.rounds:
        c = r.checks
        failed = {i.split("@")[0]: code for i, code in c["failed"].items()}
        for w in range(args.workers):
            who = f"worker-{w}"
            history[who] = [failed.get(who), *history.get(who, [])]
            if who not in quarantined and quarantine_reason(history[who]) is not None:
                quarantined[who] = r.round
        for code, n in c["left_out"].items():
            left_out[code] = left_out.get(code, 0) + n
        scored += c["scored"]
        if c["min_median_cosine"] is not None:
            cosines.append(c["min_median_cosine"])
        if c["min_gain"] is not None:
            gains.append(c["min_gain"])
        codes = ", ".join(f"{k} {n}" for k, n in c["left_out"].items()) or "-"
        print(
            f"{r.round:>5} {r.accepted + r.left_out:>7} {c['scored']:>6} {codes:<24} "
            f"{_num(c['min_median_cosine']):>10} {_num(c['min_gain']):>9} {r.eval_loss:>9.4f}"
        )
    once = sum(left_out.values())
    low_cos, low_gain = _num(min(cosines, default=None)), _num(min(gains, default=None))
    print(f"\n{args.workers * len(result.rounds)} honest uploads, {scored} scored, in "
          f"{seconds:.0f} s; {once} left out once ({left_out or 'none'}); smallest cosine "
          f"{low_cos}, smallest gain kept {low_gain}")  # fmt: skip
    met = not quarantined
    print(
        f"Goal: no honest volunteer quarantined ({args.workers} volunteers, {args.rounds} "
        f"rounds): {len(quarantined)} quarantined{' ' + str(quarantined) if quarantined else ''}"
        f" -> {'met' if met else 'NOT MET'}"
    )
    if args.json:
        rounds = [{"round": r.round, **r.checks} for r in result.rounds]
        out = {"left_out": left_out, "quarantined": quarantined, "rounds": rounds}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    if not met:
        sys.exit(1)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:+.4f}"


if __name__ == "__main__":
    main()
