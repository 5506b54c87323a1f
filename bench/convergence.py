"""Convergence benchmark: does our DiLoCo train about as well as data-parallel training?

For each K (``--workers``) and seed: ``single`` (worker 0 alone on its shard), ``ddp`` (K x
the batch, one step at a time) and DiLoCo at every H of ``--hs``, each a ``diloco simulate``
in its own process (one CPU thread, ``--jobs`` at a time: bench/sim_jobs.py), with the
platform's defaults for everything the arm does not name. Then it writes its own section of
docs/benchmarks.md (bench/doc_sections.py: no other section is touched) and a plot.

Two paths, each with its own defaults (every one can be overridden):

- ``--arch gpt``: a byte-level GPT 4 x 128 on tinyshakespeare, K = 4, H = 10 and 25, two
  seeds, with fp32 and 30%-dropped arms beside int8 at the first H (all Hs with ``--full``);
- ``--arch llama``, the real path: a Llama 2 x 128 (RoPE, RMSNorm, SwiGLU, grouped-query
  attention) on the corpus tokenized by ``diloco data prepare`` with a BPE trained on it
  (``--vocab``), K = 4 and 8, H = 10, 25 and 50, five seeds, int8.

    python bench/convergence.py --arch llama    # ~45 min on 2 cores (50 runs)
    python bench/convergence.py                 # the GPT: ~40 min on 2 cores
    python bench/convergence.py --quick         # a smoke run of the pipeline (seconds)

The limits (the share of the single -> ddp gap recovered, the distance to ddp, no seed
worse than its lone worker) and their verdicts are computed and printed by the script
(bench/convergence_report.py). Finished runs are kept under --work-dir and reused; pass
--fresh to recompute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence_report import render
from doc_sections import replace_section
from sim_jobs import run_simulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.support.corpora import TINYSHAKESPEARE as DEFAULT_DATA  # noqa: E402

# each path's defaults; the command printed in the doc names whatever differs from them
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt": dict(n_layer=4, n_embd=128, block_size=128, batch_size=16, steps=400, hs=[10, 25],
                seeds=[0, 1], workers=[4]),
    "llama": dict(n_layer=2, n_embd=128, block_size=64, batch_size=8, steps=400,
                  hs=[10, 25, 50], seeds=[0, 1, 2, 3, 4], workers=[4, 8]),
}  # fmt: skip
QUICK = dict(n_layer=1, n_embd=32, block_size=32, batch_size=4, steps=20, hs=[5], warmup=2,
             eval_windows=16, vocab=300)  # fmt: skip


@dataclass(frozen=True)
class Arm:
    key: str
    label: str
    mode: str
    H: int
    compression: str = "none"
    drop_prob: float = 0.0
    single_data: str = "shard"


def arms_for(hs: list[int], *, full: bool, arch: str) -> list[Arm]:
    """Baselines, then DiLoCo: int8 at every H; on the GPT path also fp32 and 30% dropped
    at the first H (at every H with ``full``) and single on the whole training split."""
    h0 = hs[0]  # the baselines are evaluated every h0 steps, like DiLoCo at h0
    arms = [
        Arm("single", "single (worker 0 alone on its shard)", "single", h0),
        Arm("ddp", "ddp (Kx batch, all-reduce each step)", "ddp", h0),
    ]
    if arch == "llama":
        return arms + [Arm(f"diloco_h{h}_int8", f"DiLoCo H={h} int8", "diloco", h, "int8")
                       for h in hs]  # fmt: skip
    arms.insert(1, Arm("single_all", "single on the whole training split", "single", h0,
                       single_data="all"))  # fmt: skip
    for h in hs:
        variants = [
            Arm(f"diloco_h{h}_fp32", f"DiLoCo H={h} fp32", "diloco", h, "none"),
            Arm(f"diloco_h{h}_int8", f"DiLoCo H={h} int8", "diloco", h, "int8"),
            Arm(f"diloco_h{h}_int8_drop30", f"DiLoCo H={h} int8, 30% dropped", "diloco", h,
                "int8", 0.3),
        ]  # fmt: skip
        arms += variants if (h == h0 or full) else variants[1:2]
    return arms


def write_config(path: Path, args: argparse.Namespace, *, pins: bool = True) -> None:
    """The run config every arm shares: the platform's defaults for [outer] and
    ``first_round``, except, with ``pins``, the GPT table's pinned start (measured before
    issue 14) and AdamW moment kept across rounds (measured before issue 24)."""
    pinned = pins and args.arch == "gpt"
    outer = '[outer]\nfirst_round = "nesterov"\n' if pinned else ""
    kept = "reset_momentum = false\n" if pinned else ""
    if args.arch == "llama":
        model = f'arch = "llama"\nn_kv_head = {args.n_kv_head}\n'
        data = f'dataset = "{args.dataset}"\nchunk_size = 4096\n'
    else:
        model, data = "", f'path = "{args.data}"\nval_fraction = 0.05\nchunk_size = 8192\n'
    path.write_text(
        f'name = "convergence-bench"\n[model]\n{model}n_layer = {args.n_layer}\n'
        f"n_head = {args.n_head}\nn_embd = {args.n_embd}\nblock_size = {args.block_size}\n"
        f"[data]\n{data}[inner]\n"
        f"steps = 10\nbatch_size = {args.batch_size}\nlr = {args.inner_lr}\n"
        f"warmup_steps = {args.warmup}\n{kept}{outer}",
        encoding="utf-8",
    )


def result_path(args: argparse.Namespace, k: int, arm: Arm, seed: int) -> Path:
    return args.work_dir / f"k{k}_{arm.key}_seed{seed}.json"


def run_arm(arm: Arm, k: int, seed: int, args: argparse.Namespace, config: Path) -> Path:
    out = result_path(args, k, arm, seed)
    if out.exists() and not args.fresh:
        return out
    flags = ["--workers", str(k), "--mode", arm.mode, "--seed", str(seed),
             "--inner-steps", str(arm.H), "--rounds", str(args.steps // arm.H),
             "--compression", arm.compression, "--drop-prob", str(arm.drop_prob),
             "--single-data", arm.single_data,
             "--eval-windows", str(args.eval_windows), "--device", args.device]  # fmt: skip
    started = time.perf_counter()
    run_simulate(config, flags, out.with_suffix(".tmp"))
    out.with_suffix(".tmp").rename(out)
    print(f"  K={k} {arm.key} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
    return out


def command_line(args: argparse.Namespace) -> str:
    """``python bench/convergence.py`` with every option that differs from its path's
    defaults, so the doc's command regenerates exactly its table."""
    words = ["python bench/convergence.py"] + (["--arch llama"] if args.arch == "llama" else [])
    if args.quick:
        return " ".join([*words, "--quick"])
    for name, default in DEFAULTS[args.arch].items():
        value = getattr(args, name)
        if value != default:
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            words.append(f"--{name.replace('_', '-')} {shown}")
    for name in ("vocab", "n_head", "n_kv_head", "inner_lr", "warmup", "eval_windows", "device"):
        if getattr(args, name) != PARSER_DEFAULTS[name]:
            words.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    return " ".join(words + (["--full"] if args.full else []))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--vocab", type=int, default=1024, help="llama: the BPE's vocabulary")
    p.add_argument("--n-kv-head", type=int, default=2, help="llama: key/value heads")
    p.add_argument("--seeds", type=int, nargs="+", help="gpt: 0 1; llama: 0 1 2 3 4")
    p.add_argument("--hs", type=int, nargs="+", help="gpt: 10 25; llama: 10 25 50")
    p.add_argument("--workers", type=int, nargs="+", help="K; gpt: 4; llama: 4 8")
    p.add_argument("--steps", type=int, help="inner steps per worker (400)")
    p.add_argument("--n-layer", type=int, help="gpt: 4; llama: 2")
    p.add_argument("--n-embd", type=int, help="128")
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, help="gpt: 128; llama: 64")
    p.add_argument("--batch-size", type=int, help="sequences per worker per step (gpt 16, llama 8)")
    p.add_argument("--inner-lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at once (GPU: 1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda: its own section of the doc")
    p.add_argument("--work-dir", type=Path, default=None, help="bench/out/convergence-ARCH")
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    p.add_argument(
        "--full",
        action="store_true",
        help="gpt: fp32 and 30%%-drop arms at every H, not the first only",
    )
    p.add_argument("--fresh", action="store_true", help="recompute finished runs")
    p.add_argument("--quick", action="store_true", help="tiny smoke run; writes under --work-dir")
    return p


PARSER_DEFAULTS = {a.dest: a.default for a in parser()._actions}


def main() -> None:
    args = parser().parse_args()
    for name, default in DEFAULTS[args.arch].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    llama = args.arch == "llama"
    args.work_dir = args.work_dir or REPO / "bench" / "out" / f"convergence-{args.arch}"
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
        args.seeds, args.workers = args.seeds[:2], [2, 3] if llama else [2]
        args.doc = args.work_dir / "benchmarks.md"
    if not args.data.exists():
        sys.exit(f"data file not found: {args.data} (pass --data)")
    if any(args.steps % h for h in args.hs):
        sys.exit(f"--steps {args.steps} must be a multiple of every H in {args.hs}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if llama:
        args.dataset = prepare_dataset(args)
    config = args.work_dir / "config.toml"
    write_config(config, args)

    arms = arms_for(args.hs, full=args.full, arch=args.arch)
    # the runs the acceptance checks need first, so a partial run already tells
    first = {"single": 0, "ddp": 1, f"diloco_h{args.hs[0]}_int8": 2}
    jobs = sorted(
        ((k, a, s) for k in args.workers for s in args.seeds for a in arms),
        key=lambda j: (j[0], first.get(j[1].key, 3), j[2]),
    )
    print(f"{len(jobs)} runs, {args.jobs} at a time", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        paths = list(pool.map(lambda j: run_arm(j[1], j[0], j[2], args, config), jobs))
    results: dict[int, dict[str, list[dict]]] = {k: {a.key: [] for a in arms} for k in args.workers}
    for (k, arm, _), path in zip(jobs, paths, strict=True):
        results[k][arm.key].append(json.loads(path.read_text()))

    from diloco.simulate.plot import plot_results

    # the GPT's plot keeps the name the README shows; a GPU run has a section of its own
    gpu = "-gpu" if args.device != "cpu" else ""
    stem = "convergence" + ("-llama" if llama else "") + gpu + ("-quick" if args.quick else "")
    plot_path = args.doc.parent / f"{stem}.png"
    k0 = args.workers[0]
    plot_results(
        [{**results[k0][a.key][0], "label": a.label} for a in arms],
        plot_path,
        title=f"tinyshakespeare, {args.arch}, K={k0}: eval loss (seed {args.seeds[0]})",
    )
    section = render(arms, results, args, command_line(args), plot_path.name)
    replace_section(args.doc, f"convergence-{args.arch}{gpu}", section,
                    after=f"convergence-{args.arch}" if gpu else "convergence-gpt" if llama
                    else None)  # fmt: skip
    print(section)


def prepare_dataset(args: argparse.Namespace) -> Path:
    """The corpus tokenized with a BPE trained on it (``diloco data prepare``), once."""
    out = args.work_dir / f"dataset-bpe{args.vocab}"
    if (out / "manifest.json").exists() and not args.fresh:
        return out
    # every 20th block of 8,192 tokens held out: about 5% of tinyshakespeare, as the GPT's
    cmd = [sys.executable, "-m", "client.cli", "data", "prepare", str(args.data), "--out",
           str(out), "--tokenizer", f"train:{args.vocab}", "--val-every", "20", "--force",
           "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return out


if __name__ == "__main__":
    main()
