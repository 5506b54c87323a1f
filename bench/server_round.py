"""Server round benchmark: upload ingest, aggregation + outer step, peak RSS.

Starts a real `diloco serve` (embedded Postgres in a temp dir, or the database named by
DILOCO_BENCH_DATABASE_URL), creates a run with a ~10M-parameter model, uploads K int8
contributions over loopback HTTP from this process (synthetic Δs: training them would only
measure the CPU), lets the round close, and prints:

- upload ingest MB/s (body bytes over the wall time of each PUT, median and total);
- the close stages from the server's /metrics: load, aggregate, outer step, eval, write;
- the server's peak RSS (VmHWM) and its size relative to the fp32 model.

    python bench/server_round.py [--n-layer 6 --n-embd 384 --contributions 8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from diloco.exchange import encode_delta  # noqa: E402
from diloco.wire import ContributionMeta, encode_contribution  # noqa: E402

API = "/api/v1"
ADMIN = "adm_bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(check, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise SystemExit("no VmHWM in /proc: this benchmark needs Linux")


def stage_seconds(metrics: str) -> dict[str, float]:
    pattern = re.compile(r'^diloco_round_close_stage_seconds_sum\{stage="(\w+)"\} (\S+)$', re.M)
    return {m.group(1): float(m.group(2)) for m in pattern.finditer(metrics)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--contributions", type=int, default=8)
    ap.add_argument("--data", type=Path, default=REPO / "examples/data/shakespeare-excerpt.txt")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        port = free_port()
        cmd = [sys.executable, "-m", "client.cli", "serve", "--port", str(port)]
        cmd += ["--data-dir", str(Path(tmp) / "srv")]
        if url := os.environ.get("DILOCO_BENCH_DATABASE_URL"):
            cmd += ["--database-url", url]
        env = {**os.environ, "DILOCO_ADMIN_TOKEN": ADMIN, "DILOCO_SWEEP_INTERVAL_S": "0.2"}
        log = open(Path(tmp) / "server.log", "wb")  # noqa: SIM115
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            run(args, f"http://127.0.0.1:{port}", server.pid)
        finally:
            os.kill(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
            log.close()


def run(args: argparse.Namespace, base_url: str, pid: int) -> None:
    http = httpx.Client(base_url=base_url, timeout=120)
    wait(lambda: http.get("/healthz").status_code == 200, 120, "the server")
    config = {
        "name": "bench-server-round",
        "model": {"n_layer": args.n_layer, "n_head": 6 if args.n_embd % 6 == 0 else 4,
                  "n_embd": args.n_embd, "block_size": 128},
        "data": {"path": args.data.name},
        "inner": {"steps": 1},
        "rounds": {"quorum": args.contributions, "target": args.contributions,
                   "timeout_s": 3600, "max_rounds": 10},
    }  # fmt: skip
    r = http.post(
        f"{API}/runs",
        data={"config": json.dumps(config)},
        files={"data": (args.data.name, args.data.read_bytes(), "text/plain")},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    r.raise_for_status()
    run_info = r.json()
    run_id, n_params = run_info["id"], run_info["n_params"]
    rss_before = peak_rss_mib(pid)

    # K volunteers: join, then a synthetic Δ (the shapes of the checkpoint), int8, upload
    from safetensors.torch import load as safetensors_load

    times, sizes = [], []
    params = None
    for i in range(args.contributions):
        token = http.post(f"{API}/contributors", json={"name": f"bench{i}"}).json()["token"]
        auth = {"Authorization": f"Bearer {token}"}
        lease = http.post(f"{API}/runs/{run_id}/join", headers=auth).json()
        if params is None:
            params = safetensors_load(http.get(lease["checkpoint"]["url"]).content)
        gen = torch.Generator().manual_seed(i)
        delta = {n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in params.items()}
        encoded, codec = encode_delta(delta, kind="int8", block_size=4096)
        meta = ContributionMeta(run_id, lease["round"], lease["base_version"], 16 * 128, 1, 3.0,
                                codec)  # fmt: skip
        body = b"".join(encode_contribution(meta, encoded))
        start = time.perf_counter()
        put = http.put(f"{API}/runs/{run_id}/rounds/1/contribution", content=body,
                       headers={**auth, "Content-Type": "application/octet-stream"})  # fmt: skip
        times.append(time.perf_counter() - start)
        sizes.append(len(body))
        put.raise_for_status()
    wait(lambda: http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"] == 1, 600,
         "the round to close")  # fmt: skip
    stages = stage_seconds(http.get("/metrics").text)
    rss = peak_rss_mib(pid)

    mb = [s / t / 1e6 for s, t in zip(sizes, times, strict=True)]
    model_mib = n_params * 4 / 2**20
    print(f"model: {n_params:,} parameters ({model_mib:.1f} MiB fp32); "
          f"{args.contributions} contributions of {sizes[0]:,} bytes "
          f"({sizes[0] / n_params:.3f} bytes/parameter)")  # fmt: skip
    print(f"upload ingest: median {statistics.median(mb):8.1f} MB/s   "
          f"overall {sum(sizes) / sum(times) / 1e6:8.1f} MB/s")  # fmt: skip
    for stage in ("load", "aggregate", "step", "eval", "write"):
        print(f"close stage {stage:<10s} {stages.get(stage, float('nan')):8.3f} s")
    agg_step = stages.get("aggregate", 0) + stages.get("step", 0)
    print(f"aggregation + outer step: {agg_step:.3f} s")
    print(f"server peak RSS: {rss:.0f} MiB (after run creation {rss_before:.0f} MiB; "
          f"{rss / model_mib:.1f}x the fp32 model)")  # fmt: skip


if __name__ == "__main__":
    main()
