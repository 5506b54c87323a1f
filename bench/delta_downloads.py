"""Delta downloads: the bytes a returning worker downloads, delta beside checkpoint.

The same config and seeds twice through ``diloco.simulate.run``: ``downloads="full"`` and
``downloads="delta"``. The simulator runs the server's close, which publishes θ through
the int8 delta with error feedback either way, so both train identically from θ (the
difference printed is 0 by construction; x = θ + r's loss is shown for information);
what differs is the bytes a returning worker downloads per round. Exits 1 when the mean
difference is over the limit.

    python bench/delta_downloads.py             # 2 seeds, ~6 min on one CPU thread (4 runs)
    python bench/delta_downloads.py --quick     # a smoke run (~20 s)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.support.corpora import TINYSHAKESPEARE  # noqa: E402

LIMIT = 0.002  # delta's final eval loss at most +0.2% above full's


def config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from diloco.config import parse_config

    return parse_config(
        {
            "name": "delta-downloads-bench",
            "model": {
                "n_layer": args.n_layer,
                "n_head": 4,
                "n_embd": args.n_embd,
                "block_size": args.block_size,
            },
            "data": {"path": str(args.data), "val_fraction": 0.05, "chunk_size": 8192},
            "inner": {
                "steps": args.H,
                "batch_size": args.batch_size,
                "lr": args.inner_lr,
                "weight_decay": 0.1,
                "warmup_steps": args.warmup,
                "grad_clip": 1.0,
            },
            "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
            "rounds": {"max_rounds": args.steps // args.H, "quorum": 1},
            "compression": {"kind": "int8"},
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, default=TINYSHAKESPEARE)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("-H", type=int, default=10, help="inner steps per round")
    p.add_argument("--steps", type=int, default=200, help="inner steps per worker")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--inner-lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-windows", type=int, default=64, help="per round (the final: all)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = p.parse_args()
    if args.quick:
        args.steps, args.H, args.n_layer, args.n_embd, args.block_size = 20, 5, 1, 32, 32
        args.batch_size, args.warmup, args.eval_windows, args.seeds = 4, 2, 8, args.seeds[:1]
    if not args.data.exists():
        sys.exit(f"data file not found: {args.data} (pass --data)")
    if args.steps % args.H:
        sys.exit(f"--steps {args.steps} must be a multiple of -H {args.H}")

    import torch

    from diloco.simulate.run import SimOptions, simulate

    torch.set_num_threads(1)
    cfg = config(args)
    rounds = cfg.rounds.max_rounds
    print(
        f"K={args.workers}, H={args.H}, {rounds} rounds, {args.n_layer} layers x "
        f"{args.n_embd}, context {args.block_size}, int8 uploads and deltas "
        f"(block {cfg.compression.block_size}); seeds {args.seeds}",
        flush=True,
    )
    rows = []
    for seed in args.seeds:
        runs = {}
        for downloads in ("full", "delta"):
            started = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                # write the delta files too: their size on disk is the figure reported
                opts = SimOptions(
                    workers=args.workers,
                    seed=seed,
                    eval_windows=args.eval_windows,
                    downloads=downloads,  # type: ignore[arg-type]
                    delta_dir=Path(tmp) if downloads == "delta" else None,
                )
                runs[downloads] = result = simulate(cfg, opts)
                on_disk = [f.stat().st_size for f in Path(tmp).glob("delta-*.safetensors")]
            if result.delta is not None:
                assert on_disk and max(on_disk) == result.delta.delta_bytes
            wall = time.perf_counter() - started
            print(f"  seed {seed} {downloads}: {wall:.0f} s", flush=True)
        rows.append((seed, runs["full"], runs["delta"]))

    print("\n| seed | full (x) | delta (θ) | delta's x | difference | limit | holds |")
    print("|---|---|---|---|---|---|---|")
    diffs = []
    for seed, full, delta in rows:
        assert delta.delta is not None and delta.delta.final_eval_loss_outer is not None
        diff = (delta.final_eval_loss - full.final_eval_loss) / full.final_eval_loss
        diffs.append(diff)
        print(
            f"| {seed} | {full.final_eval_loss:.4f} | {delta.final_eval_loss:.4f} "
            f"| {delta.delta.final_eval_loss_outer:.4f} | {diff:+.3%} | +{LIMIT:.1%} "
            f"| {'yes' if diff <= LIMIT else 'NO'} |"
        )
    mean = statistics.fmean(diffs)
    print(f"| mean | | | | {mean:+.3%} | +{LIMIT:.1%} | {'yes' if mean <= LIMIT else 'NO'} |")

    report = rows[0][2].delta
    assert report is not None
    full_down, delta_down = rows[0][1].bytes_down_per_worker, rows[0][2].bytes_down_per_worker
    residuals = report.residual_norms
    print(
        f"\nper round, a returning worker downloads {report.delta_bytes:,} bytes (delta) "
        f"instead of {report.checkpoint_bytes:,} (fp32 checkpoint): "
        f"{report.checkpoint_bytes / report.delta_bytes:.2f}x fewer; over the run "
        f"{delta_down:,} instead of {full_down:,} bytes per worker "
        f"({full_down / delta_down:.2f}x fewer)"
    )
    moves = [r.update_norm for r in rows[0][2].rounds if r.update_norm is not None]
    print(
        f"‖x − θ‖ after each round (seed {rows[0][0]}): first {residuals[0]:.2e}, "
        f"max {max(residuals):.2e}, last {residuals[-1]:.2e}; each outer step moved x by "
        f"{min(moves, default=0):.2f} to {max(moves, default=0):.2f}"
    )
    print(f"{rows[0][1].n_params:,} parameters")
    if mean > LIMIT:
        sys.exit(f"delta downloads cost {mean:+.3%} of final eval loss: over the +{LIMIT:.1%}")


if __name__ == "__main__":
    main()
