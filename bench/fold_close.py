"""The close after the deadline when uploads were folded as they arrived (issue 29, item 1).

For each size, K synthetic int8 uploads (real wire bodies) of one round of a clipped-mean
run with history (a folded round, ``diloco.outer.fold``), closed by ``close_round`` in this
process, twice on the same files:

- **reads every upload**: no running sum (a close that finds none: another process, a
  restart), the close as it was;
- **folded**: the first K − 1 uploads folded one by one as they would arrive (each fold
  timed: one upload a pass, the server's slowest case per upload; it folds those that
  arrived since its last pass together, up to 16), then the close adds the last one:
  what is left after the deadline.

Both must publish the same bytes (checked). Beside them, measured in the same run: the
bytes-moved bound of what the folded close must still do before it publishes (the last
upload, the running sum, θ, momentum and residual read, the delta written: 22 bytes a
parameter at int8; the parameters and the outer state are written by the close's second
pass, after the publish, timed on a row of its own), at the copy bandwidth torch reaches
here on every core; and, for comparison, the bound with θ, momentum and residual written
too (34 bytes a parameter: the close before its second pass existed).

    python bench/fold_close.py [--sizes 10M,50M,150M --uploads 8]
    python bench/fold_close.py --sizes 10M --uploads 1000   # a thousand uploads
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.doc_sections import replace_section  # noqa: E402
from bench.server_round import SIZES, copy_bandwidth  # noqa: E402
from bench.transport import contribution_body  # noqa: E402
from diloco.config import parse_config  # noqa: E402
from diloco.model.architectures import parameter_shapes  # noqa: E402
from diloco.outer.attempt import open_base  # noqa: E402
from diloco.outer.close import (  # noqa: E402
    CloseInputs,
    Folding,
    Upload,
    VersionPaths,
    close_round,
)
from diloco.outer.fold import Arrival, FoldPlan, FoldState  # noqa: E402
from diloco.outer.inspection import UploadInspector  # noqa: E402
from diloco.simulate.versions import Versions  # noqa: E402
from diloco.wire.codec import codec_from_description  # noqa: E402
from diloco.wire.contribution import decode_contribution  # noqa: E402

RUN = "run_bench"
SEED = 3  # the round's sampling seed


def config(shape: tuple[int, int, int]):  # type: ignore[no-untyped-def]
    n_layer, n_embd, n_head = shape
    raw = {
        "name": "fold-bench",
        "model": {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, "block_size": 128},
        "data": {"path": "corpus.txt"},
        "inner": {"steps": 16, "batch_size": 16},
        "compression": {"kind": "int8", "block_size": 4096},
        "aggregation": {"judge_windows": 0, "score_windows": 0},
    }
    return parse_config(raw)


def norm_of(body: bytes, shapes: dict, codec: dict) -> float:
    _, encoded = decode_contribution(body, shapes, codec=codec)
    inspector = UploadInspector(codec)
    for name, tensor in encoded.items():
        inspector.add(name, tensor)
    return inspector.norm


def bench_size(label: str, shape: tuple[int, int, int], k: int, work: Path) -> list[str]:
    cfg = config(shape)
    shapes = parameter_shapes(cfg.model)
    n = sum(math.prod(s) for s in shapes.values())
    gen = torch.Generator().manual_seed(0)
    params = {name: torch.randn(s, generator=gen) * 0.02 for name, s in shapes.items()}
    versions = Versions(cfg, params, run_id=RUN)
    del params
    lease = {"round": 1, "base_version": 0}
    codec = codec_from_description({"kind": "int8", "block_size": 4096}).describe()
    uploads = []
    for i in range(k):  # each a Δ of its own: copies would be left out by the checks
        body = contribution_body(RUN, lease, shapes, i)
        path = work / f"u{i}.bin"
        path.write_bytes(body)
        uploads.append(Upload(f"c{i}", path, 2048.0 * (1 + i % 3), norm_of(body, shapes, codec)))
    del body
    history = [statistics.median(u.norm for u in uploads)] * 3
    plan = FoldPlan.of_run(cfg, history)
    assert plan is not None

    def close(folder: Path | None, name: str) -> tuple[float, dict, bytes, int]:
        out = work / name
        out.mkdir()
        paths = VersionPaths(out / "p", out / "s", out / "d")
        inputs = CloseInputs(
            RUN, 1, cfg, versions.latest.params, versions.latest.state, uploads, history, 1,
            paths, check_seed=SEED, fold=Folding(plan, folder),
        )  # fmt: skip
        start = time.perf_counter()
        closed = close_round(inputs, evaluate=lambda p, d: 1.0)
        seconds = time.perf_counter() - start
        assert closed.committed and closed.pending is not None, closed.excluded
        start = time.perf_counter()
        closed.pending.write().commit_rest()  # the server's, after publishing
        stages = {**closed.seconds, "after": time.perf_counter() - start}
        digest = paths.params.read_bytes()[-64:] + paths.delta.read_bytes()[-64:]
        shutil.rmtree(out)
        return seconds, stages, digest, closed.folded

    all_s, all_stages, want, _ = close(None, "all")
    folder = work / "fold"
    fold_s = fold_all(cfg, versions, uploads[:-1], plan, folder)
    folded_s, folded_stages, got, folded = close(folder, "folded")
    assert got == want, "the folded close published other bytes"
    # the folded close took what was folded from the sum: it measures what it says it does
    assert folded == len(fold_s), f"the close took {folded} of {len(fold_s)} from the sum"
    shutil.rmtree(folder)
    versions.cleanup()

    lines = _table(label, n, k, (all_s, all_stages), fold_s, (folded_s, folded_stages))
    print("\n".join(lines), flush=True)
    return lines


def _table(
    label: str,
    n: int,
    k: int,
    reading: tuple[float, dict[str, float]],
    fold_s: list[float],
    folded: tuple[float, dict[str, float]],
) -> list[str]:
    """One size's table: the close reading every upload and the folded one (each its
    seconds and stages), the folds' seconds, beside the bytes-moved bounds of this run."""
    (all_s, all_stages), (folded_s, folded_stages) = reading, folded
    after = folded_stages.pop("after")  # the second pass, after the publish
    all_stages.pop("after")
    bw = copy_bandwidth()
    bound = 22 * n / bw
    bound_all = 34 * n / bw
    return [
        f"\n{label}: {n:,} parameters, {k} int8 uploads; copy bandwidth {bw / 1e9:.1f} GB/s\n",
        "| measure | seconds | limit (same run) | ratio |",
        "|---|---|---|---|",
        f"| close reading every upload | {all_s:.3f} | | |",
        f"| fold, per upload (median of {len(fold_s)}) | {statistics.median(fold_s):.3f} | | |",
        f"| folds, all {len(fold_s)} (during the round) | {sum(fold_s):.3f} | | |",
        f"| close after the deadline, folded: to the delta published | {folded_s:.3f} "
        f"| bound 22 B/param {bound:.3f} s | {folded_s / bound:.2f}x |",
        f"| | | (34 B/param, θ, m, r written too: {bound_all:.3f} s) "
        f"| {folded_s / bound_all:.2f}x |",
        f"| its stages | {_stages(folded_stages)} | | |",
        f"| second pass, after the publish: parameters and outer state written and fsync'd "
        f"| {after:.3f} | | |",
        f"| stages, reading every upload | {_stages(all_stages)} | | |",
        f"| speed-up after the deadline | {all_s / folded_s:.1f}x | | |",
    ]


def _stages(seconds: dict[str, float]) -> str:
    return ", ".join(f"{s} {v:.3f}" for s, v in sorted(seconds.items()))


def fold_all(cfg, versions, uploads, plan, folder) -> list[float]:  # type: ignore[no-untyped-def]
    """Fold ``uploads`` one by one as the server's round worker does; each fold's seconds."""
    inputs = CloseInputs(
        RUN, 1, cfg, versions.latest.params, versions.latest.state, uploads, [], 1,
        VersionPaths(folder, folder, folder),
    )  # fmt: skip
    base = open_base(inputs)
    base.close()
    state = FoldState(folder, base.shapes)
    seconds = []
    for u in uploads:
        start = time.perf_counter()
        arrival = Arrival(u.id, u.path, plan.factor(u.weight, u.norm))
        state.fold(plan, [SEED], [arrival], base.upload_codec)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="10M,50M,150M")
    p.add_argument("--uploads", type=int, default=8)
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    args = p.parse_args()
    torch.set_num_threads(1)  # as the server's close runs
    lines = []
    for label in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix="fold-bench-") as work:
            lines += bench_size(label, SIZES[label], args.uploads, Path(work))
    key = f"fold-close-{args.uploads}"
    command = f"python bench/fold_close.py --sizes {args.sizes} --uploads {args.uploads}"
    title = f"## The close after the deadline, uploads folded as they arrived ({args.uploads})"
    replace_section(args.doc, key, f"{title}\n\n```\n{command}\n```\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
