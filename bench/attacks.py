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
- with no attacker, robust aggregation costs at most +0.5% against the plain mean.

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

from diloco.simulate.attacks import ATTACKS  # noqa: E402
from tests.support.corpora import TINYSHAKESPEARE  # noqa: E402

METHODS = ("mean", "clipped_mean", "centered_clip")
DEFAULT_METHOD = "clipped_mean"
WORKERS = 5
GOAL_ONE = 0.03  # robust on, one attacker: at most +3% final eval loss
GOAL_TWO_DIRECTION = 0.05  # robust on, two direction attackers of five: at most +5%
DIRECTION = ("sign_flip", "noise", "alie")
GOAL_FREE = 0.005  # robust on, no attacker: at most +0.5% against the plain mean


@dataclass(frozen=True)
class Arm:
    method: str
    attack: str | None  # None: no attacker
    attackers: int  # how many of the workers make the attack (the last ones)

    @property
    def key(self) -> str:
        return f"{self.method}/{self.attack or 'none'}/{self.attackers}"


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
    result = simulate(
        cfg,
        SimOptions(workers=WORKERS, seed=0, eval_windows=eval_windows, attacks=attacks),  # type: ignore[arg-type]
    )
    return {
        "key": arm.key,
        "final_eval_loss": result.final_eval_loss,
        "refused": sum(r.refused for r in result.rounds),
        "left_out": sum(r.left_out for r in result.rounds),
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
    print(
        f"{len(arms)} runs: {WORKERS} volunteers, {rounds} rounds of H=20 on {args.data.name}, "
        f"{args.jobs} at a time",
        file=sys.stderr,
    )
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_arm, a, str(args.data), rounds, eval_windows) for a in arms]
        results = {f.result()["key"]: f.result() for f in futures}
    met = report(results, attacks, methods, time.perf_counter() - started)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if not met:
        sys.exit(1)


def report(
    results: dict[str, dict], attacks: tuple[str, ...], methods: tuple[str, ...], seconds: float
) -> bool:
    """Print the table and the goals; whether both goals were met."""
    free = {m: results[Arm(m, None, 0).key]["final_eval_loss"] for m in methods}
    truth = free["mean"]  # the attack-free run of the plain mean: what training reaches
    print("\nattack-free final eval loss: " + ", ".join(f"{m} {free[m]:.4f}" for m in methods))
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
    return ok_one and (ok_two or not directed) and ok_free


if __name__ == "__main__":
    main()
