"""Attack benchmark: 5 volunteers, 1 (then 2) of them hostile, through the server's own
defences in the simulator (``diloco simulate``, diloco mode: every upload checked as the
server checks it, the robust aggregate, the guarded outer step).

For each attack of ``diloco.simulate.attacks`` and each aggregation method (``mean``: robust
aggregation off; ``clipped_mean``: the default; ``centered_clip``), it prints the final
eval loss beside the attack-free run's, and the goals:

- with robust aggregation on (the default method), every single-attacker case ends within
  +3% of the attack-free loss;
- with the default method, 2 of the 5 making a direction attack (``DIRECTION``: a sign
  flip, noise at the honest norm, ALIE) end within +5%;
- with no attacker, robust aggregation costs at most +0.5% against the plain mean;
- with the default method, each freeloader (``attacks.FREELOADERS``: zeros, noise, a
  copycat, a stale Δ, a stale base, other data) is found out within 3 rounds: refused, left
  out by the close's checks or scoring, or named the round's suspect
  (``diloco.protocol.audit.suspect``), which the server audits by replay
  (``bench/audit.py``: every such forgery fails it).

The close's cheap checks and its scoring (issue 26) run in every arm, as on a server.

    python bench/attacks.py [--rounds 12] [--jobs 2] [--json out.json]
    python bench/attacks.py --quick          # a smoke run (one attack, one round)

Runs go to worker processes (one torch thread each, ``--jobs`` at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from diloco.protocol.reputation import EARNED_AT  # noqa: E402
from diloco.simulate.attacks import ATTACKS, FREELOADERS  # noqa: E402
from tests.support.corpora import TINYSHAKESPEARE  # noqa: E402

METHODS = ("mean", "clipped_mean", "centered_clip")
DEFAULT_METHOD = "clipped_mean"
WORKERS = 5
GOAL_ONE = 0.03  # robust on, one attacker: at most +3% final eval loss
GOAL_TWO_DIRECTION = 0.05  # robust on, two direction attackers of five: at most +5%
DIRECTION = ("sign_flip", "noise", "alie")
GOAL_FREE = 0.005  # robust on, no attacker: at most +0.5% against the plain mean
GOAL_FOUND_ROUNDS = 3  # each freeloader found out within this many rounds


@dataclass(frozen=True)
class Arm:
    method: str
    attack: str | None  # None: no attacker
    attackers: int  # how many of the workers make the attack (the last ones)
    start: int = 1  # the round the attack begins (honest before: an account with standing)

    @property
    def key(self) -> str:
        begins = f"/from{self.start}" if self.start != 1 else ""
        return f"{self.method}/{self.attack or 'none'}/{self.attackers}{begins}"


def config(data: Path, rounds: int, method: str) -> dict:
    return {
        "name": "attacks",
        "seed": 0,
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
        "data": {"path": str(data), "val_fraction": 0.1, "chunk_size": 4096},
        "inner": {"steps": 20, "batch_size": 16, "lr": 3e-3, "warmup_steps": 5},
        "rounds": {"quorum": 1, "max_rounds": rounds},
        "compression": {"kind": "int8", "block_size": 4096},
        "aggregation": {"method": method},
    }


def run_arm(arm: Arm, data: str, rounds: int, eval_windows: int) -> dict:
    """One simulation, in a worker process."""
    import torch

    from diloco.config import parse_config
    from diloco.simulate.run import SimOptions, simulate

    torch.set_num_threads(1)
    cfg = parse_config(config(Path(data), rounds, arm.method))
    attacks = {WORKERS - 1 - i: arm.attack for i in range(arm.attackers)} if arm.attack else {}
    started = time.perf_counter()
    opts = SimOptions(workers=WORKERS, seed=0, eval_windows=eval_windows, attacks=attacks,  # type: ignore[arg-type]
                      attack_from=arm.start)  # fmt: skip
    result = simulate(cfg, opts)
    hostile = {f"worker-{w}" for w in attacks}

    def whose(ids: list[str | None]) -> set[str]:
        return {i.rsplit("@", 1)[0] for i in ids if i}

    found, drawn, named_honest = [], [], 0
    for r in result.rounds:
        if r.round >= arm.start and (
            r.refused or whose([*r.checks.get("failed", {}), r.suspect]) & hostile
        ):  # refused, left out by the checks or the scoring, or the close's suspect
            found.append(r.round)
        if r.round >= arm.start and whose(list(r.drawn)) & hostile:
            drawn.append(r.round)
        named_honest += bool(whose([r.suspect]) - hostile)
    return {
        "key": arm.key,
        "final_eval_loss": result.final_eval_loss,
        "refused": sum(r.refused for r in result.rounds),
        "left_out": sum(r.left_out for r in result.rounds),
        "found": found,  # the rounds in which the close found an attacker out
        "drawn": drawn,  # ... in which the round's secret drew one for an audit
        "honest_suspects": named_honest,  # rounds whose suspect was honest: a replay spent
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--data", type=Path, default=TINYSHAKESPEARE)
    ap.add_argument("--quick", action="store_true", help="one attack, one round, two methods")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    attacks = ("scaled100",) if args.quick else ATTACKS
    methods = METHODS[:2] if args.quick else METHODS
    rounds = 1 if args.quick else args.rounds
    eval_windows = 16 if args.quick else args.eval_windows
    arms = [Arm(m, None, 0) for m in methods]
    arms += [Arm(m, a, n) for a in attacks for n in (1, 2) for m in methods]
    start = trusted_from(rounds)  # accounts with standing that turn freeloader
    if start > 1:
        arms += [Arm(DEFAULT_METHOD, a, 1, start) for a in FREELOADERS if a in attacks]
    print(
        f"{len(arms)} runs: {WORKERS} volunteers, {rounds} rounds of H=20 on {args.data.name}, "
        f"{args.jobs} at a time",
        file=sys.stderr,
    )
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_arm, a, str(args.data), rounds, eval_windows) for a in arms]
        results = {f.result()["key"]: f.result() for f in futures}
    met = report(results, attacks, methods, rounds, time.perf_counter() - started)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if not met:
        sys.exit(1)


def report(
    results: dict[str, dict],
    attacks: tuple[str, ...],
    methods: tuple[str, ...],
    rounds: int,
    seconds: float,
) -> bool:
    """Print the table, when each attacker was found out and the goals; whether every goal
    was met."""
    free = {m: results[Arm(m, None, 0).key]["final_eval_loss"] for m in methods}
    truth = free["mean"]  # the attack-free run of the plain mean: what training reaches
    print("\nattack-free final eval loss: " + ", ".join(f"{m} {free[m]:.4f}" for m in methods))
    worst_one, worst_two = loss_table(results, attacks, methods, truth)
    late = detection(results, list(attacks), rounds)
    cost = free[DEFAULT_METHOD] / free["mean"] - 1
    print(f"\nGoals ({seconds:.0f} s):")
    ok_one = worst_one <= GOAL_ONE
    print(
        f"- {DEFAULT_METHOD}, one attacker, worst case {worst_one:+.2%} vs attack-free "
        f"(goal <= +{GOAL_ONE:.0%}) -> {'met' if ok_one else 'NOT MET'}"
    )
    directed = [a for a in DIRECTION if a in attacks]
    ok_two = worst_two <= GOAL_TWO_DIRECTION
    if directed:
        print(
            f"- {DEFAULT_METHOD}, two direction attackers ({', '.join(directed)}), worst case "
            f"{worst_two:+.2%} vs attack-free (goal <= +{GOAL_TWO_DIRECTION:.0%}) -> "
            f"{'met' if ok_two else 'NOT MET'}"
        )
    ok_free = cost <= GOAL_FREE
    print(
        f"- {DEFAULT_METHOD} with no attacker costs {cost:+.2%} against the plain mean "
        f"(goal <= +{GOAL_FREE:.1%}) -> {'met' if ok_free else 'NOT MET'}"
    )
    loaders = [a for a in FREELOADERS if a in attacks]
    ok_found = not late
    if loaders:
        print(
            f"- {DEFAULT_METHOD}, each freeloader ({', '.join(loaders)}) found out within "
            f"{GOAL_FOUND_ROUNDS} rounds of its first, by the close or the draw -> "
            + ("met" if ok_found else f"NOT MET ({', '.join(late)})")
        )
    return ok_one and (ok_two or not directed) and ok_free and ok_found


def loss_table(
    results: dict[str, dict], attacks: tuple[str, ...], methods: tuple[str, ...], truth: float
) -> tuple[float, float]:
    """Print each attack's final eval loss per method beside ``truth`` (the attack-free
    plain mean); the default method's worst with one attacker, and with two direction
    attackers."""
    head = "".join(f"  {m:>22}" for m in methods)
    print(f"\n{'attack':<16} {'attackers':>9}{head}   (final eval loss, vs attack-free mean)")
    worst_one = worst_two = 0.0
    for attack in attacks:
        for n in (1, 2):
            cells = []
            for m in methods:
                r = results[Arm(m, attack, n).key]
                rel = r["final_eval_loss"] / truth - 1
                note = f" r{r['refused']}" if r["refused"] else ""
                note += f" g{r['left_out']}" if r["left_out"] else ""
                cells.append(f"  {r['final_eval_loss']:>8.4f} {rel:+7.2%}{note:>6}")
                if m == DEFAULT_METHOD and n == 1:
                    worst_one = max(worst_one, rel)
                if m == DEFAULT_METHOD and n == 2 and attack in DIRECTION:
                    worst_two = max(worst_two, rel)
            print(f"{attack:<16} {n:>9}" + "".join(cells))
    print(
        "(r: uploads the server refused; g: contributions the close left out: its checks, "
        "its scoring or its guard)"
    )
    return worst_one, worst_two


def trusted_from(rounds: int) -> int:
    """The round the trusted freeloaders begin: after 8 rounds of honest work have earned
    them full standing (``reputation.EARNED_AT``), leaving 3 rounds or more to find them."""
    return EARNED_AT + 1 if rounds >= EARNED_AT + GOAL_FOUND_ROUNDS + 1 else 1


def detection(results: dict[str, dict], attacks: list[str], rounds: int) -> list[str]:
    """Print, for the default method, the rounds in which the server finds each attacker
    out: its close (refused, left out by the checks or the scoring, or named the round's
    suspect, audited by replay) or the audit draw (a new account's uploads are drawn far
    more often than a trusted one's); the freeloader arms not found within
    ``GOAL_FOUND_ROUNDS`` rounds of their first."""
    print(
        f"\n{DEFAULT_METHOD}: the rounds in which the server found the attackers out (close: "
        "refused, left out, or the round's suspect; draw: drawn for an audit)"
    )
    start = trusted_from(rounds)
    arms = [Arm(DEFAULT_METHOD, a, n) for a in attacks for n in (1, 2)]
    arms += [Arm(DEFAULT_METHOD, a, 1, start) for a in FREELOADERS if start > 1 and a in attacks]
    late = []
    for arm in arms:
        r = results[arm.key]
        first = min([*r["found"], *r["drawn"]], default=None)
        who = f"{arm.attack} x{arm.attackers}" + (
            f", from round {arm.start}" if arm.start > 1 else ""
        )
        print(f"  {who:<30} close {_rounds(r['found']):<28} draw {_rounds(r['drawn'])}")
        if arm.attack in FREELOADERS and (first is None or first >= arm.start + GOAL_FOUND_ROUNDS):
            late.append(who)
    free = results[Arm(DEFAULT_METHOD, None, 0).key]
    print(f"  (no attacker: an honest upload was the round's suspect in {free['honest_suspects']} "
          f"of {rounds} rounds, a replay that passes)")  # fmt: skip
    return late


def _rounds(found: list[int]) -> str:
    return ",".join(map(str, found)) if found else "-"


if __name__ == "__main__":
    main()
