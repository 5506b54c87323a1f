"""A dataset of a few GB through the whole path, never held in memory (issue 14, item 3).

1. Generates ``--gb`` of jsonl text on disk, streamed (lines of tinyshakespeare with
   random words swapped in, so no two documents repeat).
2. ``diloco data prepare`` in a subprocess, with a BPE tokenizer trained on the corpus's
   first megabytes (training on all of it would measure the trainer, not the pipeline).
3. A real ``diloco serve`` (local storage) and ``diloco run create`` of a Llama run on the
   dataset: the CLI uploads every file streamed, the server hashes and stores them, plans
   the run's data units.

(A volunteer reads only its lease's range of one shard: tests/test_datasets_api.py and
client.fetch.load_shard.) Every process's peak RSS (VmHWM, polled while it runs) is
printed beside the same figure for a small dataset measured in the same run: memory that
does not grow with the data (at most 1.5x, and under 1 GiB, while the dataset is GBs).

    python bench/dataset_scale.py                              # 2 GB: ~10 min on 2 cores
    python bench/dataset_scale.py --gb 0.05 --small-gb 0.02    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.support.corpora import TINYSHAKESPEARE as CORPUS  # noqa: E402
from tests.support.live import ADMIN_TOKEN, ServerProcess  # noqa: E402

GIB = 1 << 30


def generate(path: Path, nbytes: int, seed: int = 0) -> int:
    """Write about ``nbytes`` of jsonl; returns the documents written."""
    lines = [ln for ln in CORPUS.read_text(encoding="utf-8").splitlines() if ln.strip()]
    words = sorted({w for ln in lines for w in ln.split()})
    rng, written, docs = random.Random(seed), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < nbytes:
            start = rng.randrange(len(lines) - 40)
            body = []
            for ln in lines[start : start + rng.randrange(5, 40)]:
                parts = ln.split()
                parts[rng.randrange(len(parts))] = rng.choice(words)
                body.append(" ".join(parts))
            line = json.dumps({"text": "\n".join(body)}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def child_peak(cmd: list[str], log: Path) -> tuple[str, float]:
    """Run ``cmd`` (stdout kept, stderr to ``log``); its stdout and its peak RSS in bytes,
    VmHWM polled until it exits."""
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO)
        peak = 0.0
        while proc.poll() is None:
            try:
                peak = max(peak, vm_hwm(proc.pid))
            except (FileNotFoundError, RuntimeError):  # it just exited
                break
            time.sleep(0.2)
        out = proc.communicate()[0]
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[3:6])}... failed:\n{log.read_text()[-3000:]}")
    return out, peak


def vm_hwm(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def pipeline(work: Path, gb: float, args: argparse.Namespace) -> dict[str, float]:
    """Generate, prepare, upload and create a run on ``gb`` of text; the figures."""
    me = [sys.executable, "-m", "client.cli"]
    work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    corpus = work / "corpus.jsonl"
    docs = generate(corpus, int(gb * GIB))
    size = corpus.stat().st_size
    print(f"[{gb:g} GB] corpus: {size / GIB:.2f} GiB, {docs:,} documents "
          f"({time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
    t = time.perf_counter()
    _, prepare_rss = child_peak(
        [*me, "data", "prepare", str(corpus), "--out", str(work / "ds"), "--tokenizer",
         str(args.tokenizer), "--quiet"], work / "prepare.log",
    )  # fmt: skip
    prepare_s = time.perf_counter() - t
    manifest = json.loads((work / "ds" / "manifest.json").read_text())
    tokens = sum(s["tokens"] for s in manifest["shards"]) + manifest["val"]["tokens"]
    data_bytes = sum(f.stat().st_size for f in (work / "ds").iterdir())
    print(f"[{gb:g} GB] prepared: {tokens:,} tokens in {len(manifest['shards'])} shards, "
          f"{data_bytes / GIB:.2f} GiB, {prepare_s:.0f} s ({size / prepare_s / 1e6:.1f} MB/s "
          f"of text, {tokens / prepare_s:,.0f} tokens/s)", flush=True)  # fmt: skip
    corpus.unlink()  # keep the disk for the copies
    server = ServerProcess(data_dir=work / "srv", database_url=args.database_url)
    try:
        server.wait_ready(timeout=120)
        idle = vm_hwm(server.pid)
        config = work / "run.toml"
        config.write_text(
            'name = "scale"\n[model]\narch = "llama"\nn_layer = 2\nn_head = 4\n'
            "n_kv_head = 2\nn_embd = 128\nblock_size = 128\n[data]\n"
            f'dataset = "{work / "ds"}"\n[inner]\nsteps = 50\nbatch_size = 16\n'
        )
        t = time.perf_counter()
        created, upload_rss = child_peak(
            [*me, "run", "create", str(config), "--server", server.url, "--admin-token",
             ADMIN_TOKEN, "--json"], work / "create.log",
        )  # fmt: skip
        upload_s = time.perf_counter() - t
        run = json.loads(created)
        time.sleep(10)  # version 0's eval (a fixed cost, the same at every size) is done
        server_rss = vm_hwm(server.pid)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            cov = http.get(f"/api/v1/runs/{run['id']}/coverage").json()
    finally:
        server.stop()
    rate = data_bytes / upload_s / 1e6
    print(f"[{gb:g} GB] uploaded and created: {upload_s:.0f} s ({rate:.0f} MB/s), "
          f"{cov['units']:,} data units", flush=True)  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    return {"data": data_bytes, "prepare": prepare_rss, "upload": upload_rss,
            "server": server_rss - idle, "idle": idle}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument("--small-gb", type=float, default=0.1, help="the reference size")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--work-dir", type=Path, default=None, help="default: a temp dir, removed")
    p.add_argument("--database-url", default=os.environ.get("DILOCO_TEST_DATABASE_URL"))
    args = p.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="diloco-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        # a BPE trained on 8 MB of the same text, then every size tokenized with it
        sample = work / "sample.jsonl"
        generate(sample, 8 << 20, seed=1)
        child_peak([sys.executable, "-m", "client.cli", "data", "prepare", str(sample), "--out",
                    str(work / "tok"), "--tokenizer", f"train:{args.vocab}", "--quiet"],
                   work / "tok.log")  # fmt: skip
        args.tokenizer = work / "tok" / "tokenizer.json"
        small = pipeline(work / "small", args.small_gb, args)
        big = pipeline(work / "big", args.gb, args)
        print(f"\npeak RSS with a dataset of {big['data'] / GIB:.2f} GiB beside the same with "
              f"{small['data'] / GIB:.3f} GiB (limit: at most 1.5x, and under 1 GiB)")  # fmt: skip
        ok = True
        for key, what in (("prepare", "diloco data prepare"),
                          ("upload", "diloco run create (uploads the dataset)"),
                          ("server", "diloco serve, over its idle size")):  # fmt: skip
            ratio = big[key] / max(small[key], 1 << 20)
            holds = ratio <= 1.5 and big[key] <= GIB
            ok &= holds
            mib = (big[key] / (1 << 20), small[key] / (1 << 20))
            print(f"{what:<42} {mib[0]:>8,.0f} MiB vs {mib[1]:>6,.0f} MiB = {ratio:4.2f}x   "
                  f"{'ok' if holds else 'OVER'}")  # fmt: skip
        print(f"(the server idles at {big['idle'] / (1 << 20):,.0f} MiB)")
        sys.exit(0 if ok else 1)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
