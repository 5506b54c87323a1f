"""The close's outer step, plain torch against the fused kernel, beside the bytes-moved bound.

For each size, θ, m, r and the round's sum g (random fp32, in memory: no file is read or
written) are stepped a chunk at a time as ``diloco.outer.chunked._step_chunk`` steps them
(``CHUNK_ELEMENTS`` values, the int8 delta codec of 4096-value blocks, Nesterov with
momentum, ‖change‖² by torch's dot), by

- **plain torch**: ``diloco.outer.kernels.plain_step``, today's ops, on the torch thread
  counts named (the server's is ``DILOCO_TORCH_THREADS``; one in ``bench/server_round.py``);
- **fused**: ``diloco.outer.kernels.fused_step`` on 1 and on every core's thread;

each the least of ``REPEAT`` runs, beside the **bytes-moved bound** measured in the same run:
the bytes the step must move (θ, m, r, g read: 16 a value; θ, m, r written: 12; the codes
1 and a scale a block) at the copy bandwidth torch reaches here copying 512 MiB (read and
write counted) on every core (the machine's bound) and on one core. Before timing, every
chunk is stepped both ways from the same values and compared bit for bit (codes, scales,
change, residual, θ, m and ‖change‖²): the "same bits" column.

    python bench/close_kernels.py [--sizes 10M,50M] [--big] [--doc docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from doc_sections import replace_section  # noqa: E402

from bench.server_round import copy_bandwidth  # noqa: E402
from diloco.outer import kernels  # noqa: E402
from diloco.outer.chunked import CHUNK_ELEMENTS, Hyper  # noqa: E402
from diloco.wire.codec import Int8Codec  # noqa: E402

SIZES = {"tiny": 300_000, "10M": 10_000_000, "50M": 50_000_000, "150M": 150_000_000}
REPEAT = 3
HYPER = Hyper(0.7, 0.9, True)
CODEC = Int8Codec(4096)
Step = Callable[[torch.Tensor, list[torch.Tensor]], kernels.Published | None]


def step_bytes(n: int) -> int:
    """What the step must read and write for ``n`` values (module docstring)."""
    return 16 * n + 12 * n + n + 4 * CODEC.n_blocks(n)


def plain(g: torch.Tensor, work: list[torch.Tensor]) -> kernels.Published | None:
    theta, m, r, u, d = work
    return kernels.plain_step(HYPER, CODEC, g, theta, m, r, (u, d), has_momentum=True)


def fused(threads: int) -> Step:
    lib = kernels.library()
    assert lib is not None, "the fused kernel did not build or load here"

    def run(g: torch.Tensor, work: list[torch.Tensor]) -> kernels.Published | None:
        theta, m, r, change, _ = work
        return kernels.fused_step(
            lib, HYPER, CODEC, g, theta, m, r, change, has_momentum=True, threads=threads
        )

    return run


def chunks(n: int) -> list[tuple[int, int]]:
    return [(s, min(CHUNK_ELEMENTS, n - s)) for s in range(0, n, CHUNK_ELEMENTS)]


def sweep(state: dict[str, torch.Tensor], step: Step) -> float:
    """One step over the model a chunk at a time, in place; its seconds."""
    spare = [torch.empty(CHUNK_ELEMENTS), torch.empty(CHUNK_ELEMENTS)]
    change_sq = 0.0
    start = time.perf_counter()
    for s, k in chunks(state["g"].numel()):
        work = [state[x][s : s + k] for x in ("theta", "m", "r")] + [b[:k] for b in spare]
        done = step(state["g"][s : s + k], work)
        assert done is not None
        change_sq += float(torch.dot(done.change, done.change))
    return time.perf_counter() - start


def same_bits(state: dict[str, torch.Tensor]) -> bool:
    """Every chunk stepped both ways from the same values: the same bits?"""
    both = fused(torch.get_num_threads())
    for s, k in chunks(state["g"].numel()):
        runs = []
        for step in (plain, both):
            c = {x: t[s : s + k].clone() for x, t in state.items()}
            work = [c["theta"], c["m"], c["r"], torch.empty(k), torch.empty(k)]
            done = step(c["g"], work)
            assert done is not None
            runs.append((done, c))
        (a, ca), (b, cb) = runs
        if not kernels.same(a, b, ca, cb) or torch.dot(a.change, a.change) != torch.dot(
            b.change, b.change
        ):
            return False
    return True


def timed(state: dict[str, torch.Tensor], step: Step, torch_threads: int) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        return min(sweep(state, step) for _ in range(REPEAT))
    finally:
        torch.set_num_threads(before)


def bench_size(label: str, cores: int) -> list[str]:
    n = SIZES[label]
    gen = torch.Generator().manual_seed(0)
    state = {x: torch.randn(n, generator=gen) for x in ("theta", "m", "r", "g")}
    state["g"].mul_(1e-2)
    exact = same_bits(state)
    bw_all, bw_one = copy_bandwidth(cores), copy_bandwidth(1)
    bound_all, bound_one = step_bytes(n) / bw_all, step_bytes(n) / bw_one
    arms: list[tuple[str, Step, int]] = [
        (f"plain torch, {t} thread(s)", plain, t) for t in sorted({1, cores})
    ]
    arms += [(f"fused, {t} thread(s)", fused(t), 1) for t in sorted({1, cores})]
    times = {name: timed(state, step, threads) for name, step, threads in arms}
    base = times[arms[0][0]]
    rows = []
    for name, seconds in times.items():
        rows.append(
            f"| {label} | {name} | {seconds:.3f} s | {bound_all:.3f} s ({bw_all / 1e9:.1f} GB/s)"
            f" | {bound_all / seconds:.0%} | {bound_one / seconds:.0%} | {base / seconds:.2f}x"
            f" | {'yes' if exact else '**no**'} |"
        )
    print("\n".join(rows), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="10M,50M")
    ap.add_argument("--big", action="store_true", help="150M as well")
    ap.add_argument("--doc", type=Path, default=None, help="write the table as a section here")
    args = ap.parse_args()
    sizes = args.sizes.split(",") + (["150M"] if args.big else [])
    cores = os.cpu_count() or 1
    header = [
        "| size | step | time | bytes-moved bound, every core (copy bandwidth) "
        "| of that bound | of one core's bound | vs plain, 1 thread | same bits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(header), flush=True)
    rows = [row for label in sizes for row in bench_size(label, cores)]
    if args.doc is not None:
        replace_section(args.doc, "close-kernels", section(header + rows))


def section(table: list[str]) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return "\n".join(
        [
            "## The close's outer step: plain torch against the fused kernel "
            "(`bench/close_kernels.py`, issue 29)",
            "",
            f"{time.strftime('%Y-%m-%d')}, this machine ({os.cpu_count()} cores, load average "
            f"{load} at the end), torch {torch.__version__}. The step of `_step_chunk` on "
            f"chunks of {CHUNK_ELEMENTS} values in memory (no file IO), int8 deltas of "
            f"{CODEC.block_size}-value blocks, each the least of {REPEAT} sweeps. The bound "
            "counts 29 bytes a value (θ, m, r, g read; θ, m, r, codes written) at torch's "
            "copy bandwidth; a copy's destination is read before it is written, the step's "
            "in-place θ, m and r are not, so the step can beat this bound by up to 1.5x. "
            "'same bits': every chunk stepped both ways from the same values and compared "
            "(codes, scales, change, residual, θ, m, ‖change‖²).",
            "",
            *table,
        ]
    )


if __name__ == "__main__":
    main()
