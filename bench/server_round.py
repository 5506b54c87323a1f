"""The server's round path at 10M, 50M and 150M parameters, each stage beside its limit.

For each model size and upload kind (``--compression``: int8, and sparse with its
defaults: 64 of 4096 values, 2 bits, sparse deltas of 512 of 4096) it starts a real ``diloco serve``
(embedded Postgres, or the database in DILOCO_BENCH_DATABASE_URL), creates a run, has K
volunteers upload real contributions (synthetic Δs: training them would only measure the
CPU) over loopback HTTP, lets round 1 close, and prints every stage next to a limit
measured in this same run on this same machine, with the ratio:

- upload ingest (MB/s per upload)      raw TCP loopback, a plain uvicorn app (bench.loopback)
- the pass: aggregate + outer step     the memory-bandwidth bound (the bytes the work must
  (and its parts: read, sum, step,     move, at the copy bandwidth torch reaches here on every
  write)                               core), and a plain torch reference of the same work in
                                       memory, on one thread as the server's torch runs
- write (the delta's fsync, rename)    the same bytes written and fsync'd by plain Python
- critical path (claim to next round   1.5 x (aggregate + step + the fsync'd delta)
  open: the version published with
  its delta durable)
- full files durable (claim to the     the critical path + the parameters and outer state
  parameters and outer state           fsync'd by plain Python (delta first: off the
  committed)                           critical path)
- eval (after publishing)              the same windows through the same model in torch
- checkpoint and delta downloads       raw TCP loopback
- peak server RSS during the close     4 x the fp32 model + the idle server's RSS
- bytes a returning volunteer fetches  26% of the fp32 checkpoint (int8 deltas), 6% (sparse)

    python bench/server_round.py [--sizes 10M,50M,150M --contributions 8
                                  --compression int8,sparse]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.loopback import mbps, plain_http_mbps, raw_tcp_mbps  # noqa: E402
from bench.procstat import rss_mib  # noqa: E402
from bench.server_metrics import evals_done, metric_count, metric_sums, metrics, poll  # noqa: E402
from bench.transport import (  # noqa: E402
    API,
    contribution_body,
    create_run,
    diloco_server,
    download,
    join,
    safetensors_shapes,
    upload,
)
from diloco.config import CompressionSection  # noqa: E402
from diloco.model.gpt import GPT, GPTConfig  # noqa: E402
from diloco.train import evaluate  # noqa: E402
from diloco.wire.exchange import codec_for, delta_codec_for  # noqa: E402

# layers, width, heads; "tiny" is for the test that runs this script
SIZES = {
    "10M": (6, 384, 6),
    "50M": (8, 720, 6),
    "150M": (12, 1024, 16),
    "1B": (20, 2048, 16),
    "tiny": (1, 64, 4),
}
EVAL_WINDOWS = 16  # per version, the server's and the reference's
# what a returning volunteer's delta may weigh against the fp32 checkpoint, by its codec
DELTA_SHARE = {"int8": 0.26, "int2": 0.07, "sparse": 0.06}


@dataclass
class Figures:
    rows: list[tuple[str, str, str, str, str]]

    def add(self, stage: str, measured: str, limit: str, ratio: str, goal: str = "") -> None:
        self.rows.append((stage, measured, limit, ratio, goal))

    def print(self, title: str) -> None:
        print(f"\n## {title}\n")
        print("| stage | measured | limit (same run) | ratio | goal |")
        print("|---|---|---|---|---|")
        for row in self.rows:
            print("| " + " | ".join(row) + " |")


# ---------------------------------------------------------------- limits, in this process


def copy_bandwidth(threads: int | None = None) -> float:
    """Bytes per second torch moves copying a 512 MiB buffer (read + write counted, the best
    of 3), on ``threads`` threads (None: every core: the machine's bound, whatever the
    server uses)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        src = torch.ones(128 << 20)
        dst = torch.empty_like(src)
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        return 2 * src.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def pass_bytes(n: int, k: int, upload_nbytes: int, delta_nbytes: int) -> int:
    """What aggregate + step must move: K uploads and θ, m, r read; θ, m, r and the delta
    written."""
    return k * upload_nbytes + 12 * n + 12 * n + delta_nbytes


def torch_reference(n: int, k: int, compression: CompressionSection) -> float:
    """The same work in plain torch, whole tensors in memory: decode and sum K uploads of
    the run's codec, the Nesterov step with the residual, encode the change in the
    delta's codec, apply it."""
    gen = torch.Generator().manual_seed(0)
    codec, delta = codec_for(compression), delta_codec_for(compression)
    uploads = [codec.encode(torch.randn(n, generator=gen)) for _ in range(k)]
    theta, m, r = (torch.randn(n, generator=gen) for _ in range(3))
    start = time.perf_counter()
    g = torch.zeros(n)
    for e in uploads:
        g.add_(codec.decode(e), alpha=1.0 / k)
    m.mul_(0.9).add_(g)
    u = torch.add(g, m, alpha=0.9)
    d = torch.add(r, u, alpha=-0.7)
    change = delta.decode(delta.encode(d))
    theta.add_(change)
    d.sub_(change)
    return time.perf_counter() - start


def fsync_reference(folder: Path, nbytes: int) -> float:
    """Write ``nbytes`` (in 4 MiB pieces, as the close does) and fsync: the unavoidable."""
    piece = os.urandom(4 << 20)
    path = folder / "fsync-reference.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(piece)):
            f.write(piece)
        f.write(piece[: nbytes % len(piece)])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def eval_reference(cfg: GPTConfig, windows: int) -> float:
    model = GPT(cfg)
    val = torch.randint(0, 256, (windows * cfg.block_size + 1,), dtype=torch.uint8)
    start = time.perf_counter()
    with torch.no_grad():
        evaluate(model, val, block_size=cfg.block_size, max_windows=windows)
    return time.perf_counter() - start


# ---------------------------------------------------------------- one size


def bench_size(
    label: str, shape: tuple[int, int, int], k: int, data: Path, scratch: Path, kind: str
) -> Figures:
    n_layer, n_embd, n_head = shape
    compression = CompressionSection(kind=kind)  # type: ignore[arg-type]
    env = {"DILOCO_SWEEP_INTERVAL_S": "0.2"}
    fig = Figures([])
    with diloco_server(**env) as server:
        idle_rss = rss_mib(server.pid)
        run = create_run(server, n_layer=n_layer, n_embd=n_embd, n_head=n_head, quorum=k,
                         data=data, eval_windows=EVAL_WINDOWS, compression=kind)  # fmt: skip
        run_id, n_params = run["id"], run["n_params"]
        model_mib = n_params * 4 / 2**20
        volunteers = [join(server, run_id, f"bench{i}") for i in range(k)]
        first = download(server, volunteers[0].lease["checkpoint"]["url"], volunteers[0].token)
        shapes = safetensors_shapes(first.body)
        lease = volunteers[0].lease
        # each body encoded from a Δ of its own: copies of one are left out by the close's
        # checks (diloco.outer.checks), and the round would wait for more
        bodies = [contribution_body(run_id, lease, shapes, i, kind) for i in range(k)]
        # version 0's eval runs after run creation: let it finish before the round
        evals_done(server, 1)
        Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # peak RSS from here
        ingest = []
        for v, b in zip(volunteers, bodies, strict=True):
            ingest.append(mbps(len(b), upload(server, run_id, v, b).seconds))
        poll(lambda: server.call("GET", f"{API}/runs/{run_id}")["checkpoint_version"] == 1,  # type: ignore[index]
             900, "round 1 to close")  # fmt: skip
        poll(lambda: "to_full" in metric_sums(metrics(server), "diloco_round_close_stage_seconds"),
             900, "version 1's full files")  # fmt: skip
        peak = rss_mib(server.pid, "VmHWM")
        text = metrics(server)
        stages = metric_sums(text, "diloco_round_close_stage_seconds")
        close = metric_sums(text, "diloco_round_close_seconds")[""]
        poll(lambda: metric_count(metrics(server), "diloco_version_eval_seconds") >= 2, 900,
             "version 1's eval")  # fmt: skip
        eval_s = metric_sums(metrics(server), "diloco_version_eval_seconds")[""]
        plan = server.call("GET", f"{API}/runs/{run_id}/checkpoints/1/catch-up?from=0")
        assert isinstance(plan, dict)
        token = volunteers[0].token
        full = [download(server, plan["full"]["url"], token) for _ in range(3)]
        delta = [download(server, plan["deltas"][0]["url"], token) for _ in range(3)]
        delta_nbytes = plan["deltas"][0]["nbytes"]
        fsync_s = fsync_reference(scratch, delta_nbytes)
        fsync_full_s = fsync_reference(scratch, 12 * n_params)
    # limits measured now, in this process (the server has stopped)
    bw = copy_bandwidth()
    bound = pass_bytes(n_params, k, len(bodies[0]), delta_nbytes) / bw
    reference = torch_reference(n_params, k, compression)
    up_http = statistics.median(plain_http_mbps(len(bodies[0]), rounds=3))
    up_tcp = statistics.median(raw_tcp_mbps(len(bodies[0]), rounds=3))
    down_tcp = statistics.median(raw_tcp_mbps(full[0].nbytes, rounds=3, send=False))
    gpt = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=128)
    eval_ref = eval_reference(gpt, EVAL_WINDOWS)

    print(f"\n{label}, {kind}: {n_params:,} parameters ({model_mib:.0f} MiB fp32), {k} "
          f"uploads of {len(bodies[0]):,} B ({len(bodies[0]) / n_params:.4f} B/param); "
          f"copy bandwidth {bw / 1e9:.1f} GB/s")  # fmt: skip
    med = statistics.median(ingest)
    fig.add("ingest, per upload", f"{med:.0f} MB/s", f"plain uvicorn {up_http:.0f} MB/s; "
            f"raw TCP {up_tcp:.0f} MB/s", f"{med / up_http:.2f}; {med / up_tcp:.2f}",
            "≥ 400 MB/s")  # fmt: skip
    fig.add("load (base opened)", f"{stages.get('load', 0):.3f} s", "", "")
    agg = stages.get("pass", 0.0)
    fig.add("aggregate + step (the pass)", f"{agg:.3f} s",
            f"bandwidth bound {bound:.3f} s; torch in memory {reference:.3f} s",
            f"{bound / agg:.0%} of bound; {reference / agg:.2f}x torch",
            "≥ 50% of bound")  # fmt: skip
    parts = ", ".join(
        f"{p} {stages.get('pass_' + p, 0):.3f}" for p in ("read", "sum", "step", "write")
    )
    fig.add("  the pass's parts (s)", parts, "", "")
    write = stages.get("write", 0.0)
    fig.add("write (the delta: fsync + rename)", f"{write:.3f} s",
            f"{delta_nbytes / 1e6:.0f} MB written + fsync {fsync_s:.3f} s",
            f"{fsync_s / write:.2f}" if write else "")  # fmt: skip
    limit = 1.5 * (agg + fsync_s)
    fig.add("critical path (claim to delta published, next round open)", f"{close:.3f} s",
            f"1.5 x (pass + fsync'd delta) = {limit:.3f} s", f"{close / limit:.2f}",
            "≤ 1")  # fmt: skip
    to_full = stages.get("to_full", 0.0)
    fig.add("full files durable (claim to params + state committed)", f"{to_full:.3f} s",
            f"critical path + {12 * n_params / 1e6:.0f} MB fsync'd {fsync_full_s:.3f} s = "
            f"{close + fsync_full_s:.3f} s", f"{to_full / (close + fsync_full_s):.2f}",
            "off the critical path")  # fmt: skip
    fig.add("eval (after publishing)", f"{eval_s:.3f} s", f"torch forward {eval_ref:.3f} s",
            f"{eval_s / eval_ref:.2f}", "off the critical path")  # fmt: skip
    full_mbps = statistics.median(mbps(a.nbytes, a.seconds) for a in full)
    delta_mbps = statistics.median(mbps(a.nbytes, a.seconds) for a in delta)
    fig.add("checkpoint download", f"{full_mbps:.0f} MB/s", f"raw TCP {down_tcp:.0f} MB/s",
            f"{full_mbps / down_tcp:.2f}")  # fmt: skip
    fig.add("delta download", f"{delta_mbps:.0f} MB/s", f"raw TCP {down_tcp:.0f} MB/s",
            f"{delta_mbps / down_tcp:.2f}")  # fmt: skip
    over = peak - idle_rss
    fig.add("peak RSS during the round", f"{peak:.0f} MiB ({over:.0f} over idle)",
            f"4 x model {4 * model_mib:.0f} MiB + idle {idle_rss:.0f} MiB",
            f"{over / model_mib:.2f}x model", "≤ 4x model")  # fmt: skip
    ratio = delta_nbytes / plan["full"]["nbytes"]
    share = DELTA_SHARE[compression.download_kind]
    fig.add("returning volunteer's download", f"{delta_nbytes:,} B "
            f"({delta_nbytes / n_params:.3f} B/param, {compression.download_kind})",
            f"fp32 checkpoint {plan['full']['nbytes']:,} B", f"{ratio:.1%}",
            f"≤ {share:.0%}")  # fmt: skip
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="10M,50M,150M")
    ap.add_argument("--contributions", type=int, default=8)
    ap.add_argument("--compression", default="int8,sparse", help="upload kinds, comma-separated")
    ap.add_argument("--data", type=Path, default=REPO / "examples/data/shakespeare-excerpt.txt")
    args = ap.parse_args()
    # the references run as the server does: one torch thread (DILOCO_TORCH_THREADS)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as scratch:
        for label in args.sizes.split(","):
            for kind in args.compression.split(","):
                figures = bench_size(
                    label, SIZES[label], args.contributions, args.data, Path(scratch), kind
                )
                figures.print(f"{label}, {kind}")


if __name__ == "__main__":
    main()
