"""The first rounds of a run: does the first Nesterov outer step overshoot, and which start is
better? (issue 14, item 7)

The first outer step of Nesterov SGD moves the model by lr (1 + momentum) Δ = 1.33 Δ at
DiLoCo's defaults, from a random model where Δ is at its largest. Three starts, the same
runs otherwise (``diloco simulate``, K workers, one CPU thread each, ``--jobs`` at a time):

- ``nesterov``: the plain outer optimizer from round 1;
- ``warmup``: the outer lr ramps up linearly over the first ``--warmup`` rounds;
- ``average``: round 1 moves the model by exactly the averaged update (θ₁ = θ₀ − Δ₁).

Per configuration and seed: version 0's eval loss, each round's, the peak ratio (the
highest eval loss of rounds 1..3 over version 0's: above 1 is a spike) and the final loss.
Writes its section of docs/benchmarks.md.

    python bench/first_round.py            # ~10 min on 2 cores
    python bench/first_round.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_sections import replace_section
from sim_jobs import DEMO_MODEL, TOY_MODEL, simulate_json

REPO = Path(__file__).resolve().parents[1]
EXCERPT = REPO / "examples" / "data" / "shakespeare-excerpt.txt"
# name -> ([model] lines, [inner] lines, workers)
SETUPS = {
    "demo": (  # examples/demo.toml: H = 10
        DEMO_MODEL,
        "steps = 10\nbatch_size = 16\nlr = 2e-3\nwarmup_steps = 10\n",
        2,
    ),
    "long-H": (  # the config's default H = 50, from a random model
        DEMO_MODEL,
        "steps = 50\nbatch_size = 16\nlr = 1e-3\nwarmup_steps = 20\n",
        4,
    ),
    "hot": (  # a high constant inner lr after a short warmup: the largest first Δ
        "n_layer = 2\nn_head = 2\nn_embd = 64\nblock_size = 64\n",
        'steps = 30\nbatch_size = 8\nlr = 3e-3\nwarmup_steps = 5\nschedule = "constant"\n',
        4,
    ),
}


def arms(warmup: int) -> dict[str, str]:
    return {
        "nesterov": 'first_round = "nesterov"\nwarmup_rounds = 0\n',
        f"warmup {warmup}": f'first_round = "nesterov"\nwarmup_rounds = {warmup}\n',
        "average": 'first_round = "average"\nwarmup_rounds = 0\n',
    }


def run_one(setup: str, arm: str, seed: int, args: argparse.Namespace) -> dict:
    model, inner, workers = SETUPS[setup]
    key = f"{setup}_{arm.replace(' ', '')}_seed{seed}"
    outer = arms(args.warmup)[arm]
    toml = (
        f'name = "first-round"\n[model]\n{model}[inner]\n{inner}'
        f'[data]\npath = "{args.data}"\nval_fraction = 0.05\n'
        f"[outer]\nlr = 0.7\nmomentum = 0.9\nnesterov = true\n{outer}"
    )
    flags = ["--workers", str(workers), "--mode", "diloco", "--seed", str(seed), "--rounds",
             str(args.rounds), "--eval-windows", str(args.eval_windows)]  # fmt: skip
    return simulate_json(key, toml, flags, work_dir=args.work_dir, fresh=args.fresh)


def figures(result: dict) -> tuple[float, list[float], float, float]:
    initial = result["initial_eval_loss"]
    losses = [r["eval_loss"] for r in result["rounds"]]
    return initial, losses, max(losses[:3]) / initial, result["final_eval_loss"]


def render(results: dict, args: argparse.Namespace) -> str:
    names = list(arms(args.warmup))
    lines = [
        "## First rounds: the outer step's start (`bench/first_round.py`, issue 14)",
        "",
        "The first Nesterov outer step moves the model by lr (1 + momentum) Δ = 1.33 Δ at "
        "DiLoCo's defaults, from a random model where Δ is largest. Three starts, otherwise "
        "the same simulated runs (int8, robust clipping, the guard): `nesterov` from round "
        f"1; `warmup {args.warmup}`: the outer lr ramps linearly over the first "
        f"{args.warmup} rounds; `average`: round 1 moves the model by exactly the averaged "
        "update (θ₁ = θ₀ − Δ₁), Nesterov from round 2. Setups: `demo` = examples/demo.toml "
        "(2 workers, H = 10); `long-H` = the demo's model at the config's default H = 50, 4 "
        "workers; `hot` = a 2-layer model, inner lr 3e-3 constant after 5 warmup steps, "
        f"H = 30, 4 workers. {args.rounds} rounds, on the Shakespeare excerpt, seeds "
        f"{', '.join(map(str, args.seeds))}; eval on {args.eval_windows} validation windows. "
        "*peak* = the highest eval loss of rounds 1-3 over version 0's (above 1: a spike).",
        "",
        "```",
        "python bench/first_round.py" + (" --quick" if args.quick else ""),
        "```",
        "",
        "| setup | start | version 0 | round 1 | round 2 | round 3 | peak | final |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setup in SETUPS:
        for arm in names:
            runs = [figures(r) for r in results[setup][arm]]
            mean = statistics.fmean
            r = [mean(x[1][i] for x in runs) for i in range(min(3, len(runs[0][1])))]
            lines.append(
                f"| {setup} | {arm} | {mean(x[0] for x in runs):.3f} | "
                + " | ".join(f"{v:.3f}" for v in r)
                + f" | {max(x[2] for x in runs):.3f} | {mean(x[3] for x in runs):.4f} "
                f"± {(max(x[3] for x in runs) - min(x[3] for x in runs)) / 2:.4f} |"
            )
    lines += [
        "",
        "Means over seeds; *peak* is the worst seed's; *final* is mean ± half the spread.",
        "",
    ]
    lines += verdict(results, names)
    return "\n".join(lines)


def verdict(results: dict, names: list[str]) -> list[str]:
    """Each start's worst peak and its final loss against the plain Nesterov start."""
    out = []
    for arm in names:
        peak = max(figures(r)[2] for s in SETUPS for r in results[s][arm])
        finals = []
        for setup in SETUPS:
            mine = statistics.fmean(figures(r)[3] for r in results[setup][arm])
            base = statistics.fmean(figures(r)[3] for r in results[setup]["nesterov"])
            finals.append(f"{setup} {(mine - base) / base:+.1%}")
        out.append(f"- `{arm}`: worst peak {peak:.2f}; final against `nesterov`: "
                   f"{', '.join(finals)}.")  # fmt: skip
    out += [
        "",
        '`first_round = "average"` is the default (`diloco.config.OuterSection`): the only '
        "start with no spike in any setup and seed that never ends more than a fraction of a "
        "percent behind the plain Nesterov start; the warmup also removes the spike but "
        "starts slower where H is long.",
        "",
    ]
    return out


DEMO = REPO / "examples" / "demo.toml"


def demo_check(args: argparse.Namespace) -> list[dict]:
    """examples/demo.toml itself (its data, its rounds, every default: the start the platform
    uses), ``diloco simulate`` with its two workers, one run per ``--demo-seeds`` seed."""
    toml = DEMO.read_text(encoding="utf-8").replace(
        'path = "data/', f'path = "{DEMO.parent / "data"}/'
    )
    if args.quick:  # a toy model, H = 3, 2 rounds
        toml = re.sub(r"(?ms)^\[model\]\n.*?^\n", f"[model]\n{TOY_MODEL}\n", toml)
        toml = re.sub(r"^steps = \d+", "steps = 3", toml, flags=re.M)
        toml = re.sub(r"^max_rounds = \d+", "max_rounds = 2", toml, flags=re.M)
    flags = ["--workers", "2", "--eval-windows", str(args.eval_windows)]
    jobs = [(f"demo-config_seed{seed}", [*flags, "--seed", str(seed)]) for seed in args.demo_seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(lambda j: simulate_json(j[0], toml, j[1], work_dir=args.work_dir,
                                                     fresh=args.fresh), jobs))  # fmt: skip


def render_demo_check(runs: list[dict], args: argparse.Namespace) -> list[str]:
    """Each seed's worst round against version 0, and the limit: no round above it."""
    lines = [
        "### The demo config over many seeds",
        "",
        f"`examples/demo.toml` as it is (2 workers, H = {runs[0]['inner_steps']}, "
        f"{len(runs[0]['rounds'])} rounds, "
        'the platform\'s defaults: `first_round = "average"`), seeds '
        f"{', '.join(map(str, args.demo_seeds))}. *worst* = the highest eval loss of any "
        "round over version 0's.",
        "",
        "| seed | version 0 | round 1 | worst round | worst | final |",
        "|---|---|---|---|---|---|",
    ]
    worst = []
    for seed, run in zip(args.demo_seeds, runs, strict=True):
        losses = [r["eval_loss"] for r in run["rounds"]]
        at = max(range(len(losses)), key=losses.__getitem__)
        worst.append(losses[at] / run["initial_eval_loss"])
        lines.append(f"| {seed} | {run['initial_eval_loss']:.3f} | {losses[0]:.3f} | {at + 1} "
                     f"| {worst[-1]:.3f} | {run['final_eval_loss']:.4f} |")  # fmt: skip
    holds = "yes" if max(worst) <= 1.0 else "NO"
    lines += ["", f"Worst ratio over {len(runs)} seeds: **{max(worst):.3f}** (limit <= 1: "
              f"no round above version 0) -> {holds}.", ""]  # fmt: skip
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, default=EXCERPT)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--demo-seeds", type=int, nargs="+", default=list(range(10)))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--work-dir", type=Path, default=REPO / "bench" / "out" / "first-round")
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    p.add_argument("--fresh", action="store_true")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one seed, 3 rounds, H = 3, a toy model, into --work-dir",
    )
    args = p.parse_args()
    if args.quick:
        args.seeds, args.rounds, args.eval_windows, args.demo_seeds = [0], 3, 8, [0, 1]
        args.doc = args.work_dir / "benchmarks.md"
        for name, (_, inner, workers) in list(SETUPS.items()):  # a toy model, H = 3
            SETUPS[name] = (
                TOY_MODEL,
                re.sub(r"^steps = \d+$", "steps = 3", inner, flags=re.M),
                workers,
            )
    args.work_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(s, a, seed) for seed in args.seeds for s in SETUPS for a in arms(args.warmup)]
    print(f"{len(jobs)} runs, {args.jobs} at a time", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda j: run_one(*j, args), jobs))
    results: dict = {s: {a: [] for a in arms(args.warmup)} for s in SETUPS}
    for (setup, arm, _), result in zip(jobs, done, strict=True):
        results[setup][arm].append(result)
    section = render(results, args) + "\n" + "\n".join(render_demo_check(demo_check(args), args))
    replace_section(args.doc, "first-round", section, after="convergence-llama")
    print(section)


if __name__ == "__main__":
    main()
