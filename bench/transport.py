"""Upload ingest and checkpoint downloads beside the transport's own limits, in one run.

Every figure is printed next to the limit measured in the same run, on the same machine:

(a) raw TCP on loopback: a process that reads and discards N bytes (uploads), or sends
    them (downloads) — what the kernel allows;
(b) a plain uvicorn app (httptools, uvloop) that reads and discards a PUT body — what
    HTTP in Python allows, the bound for any ingest;
(c) our real ``diloco serve`` ingesting real int8 contributions of a ~50M-parameter model
    (~50 MB each), once version 0's eval is done: median MB/s per upload, its ratio to (b)
    and (a), and beside the goal (``INGEST_GOAL_MBPS``); then 8 concurrent
    uploads and the server's peak RSS while they stream (it must not grow with the number
    of uploads times the tensor size);
(d) the run's checkpoint (~200 MB of fp32 parameters) downloaded from the server's real
    checkpoint route, beside raw TCP sending the same bytes.

The client side is a plain socket writing HTTP/1.1 by hand (one ``sendall`` of the body,
then reading the answer), so that the client measures the server and not itself.

    python bench/transport.py [--n-layer 8 --n-embd 720 --uploads 5 --concurrent 8]

The helpers (``raw_tcp_mbps``, ``plain_http_mbps``, ``http_request``, ``DilocoServer``)
are for other benches to import.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.loopback import (  # noqa: E402
    Answer,
    free_port,
    http_request,
    mbps,
    plain_server,
    raw_tcp_mbps,
)
from bench.procstat import proc_cpu_s, rss_mib, total_cpu_s  # noqa: E402
from bench.server_metrics import evals_done  # noqa: E402

API = "/api/v1"
ADMIN = "adm_bench"
INGEST_GOAL_MBPS = 300  # per upload, on loopback (issue 29, item 4)

# ---------------------------------------------------------------- (c, d) diloco serve


class RssSampler:
    """The highest VmRSS of a process, sampled every ``interval`` s while in the block."""

    def __init__(self, pid: int, interval: float = 0.005) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib(self.pid))


class DilocoServer:
    """A real ``diloco serve`` on loopback (embedded Postgres in ``data_dir``, or the
    database named by DILOCO_BENCH_DATABASE_URL) with JSON helpers over ``http_request``."""

    def __init__(self, data_dir: Path, **env: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "client.cli", "serve", "--port", str(self.port)]
        cmd += ["--data-dir", str(data_dir / "srv")]
        if url := os.environ.get("DILOCO_BENCH_DATABASE_URL"):
            cmd += ["--database-url", url]
        full_env = {**os.environ, "DILOCO_ADMIN_TOKEN": ADMIN, **env}
        self._log = open(data_dir / "server.log", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO
        )
        self.pid = self.process.pid

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"diloco serve exited with {self.process.returncode}")
            try:
                if http_request(self.port, "GET", "/healthz").status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit("timed out waiting for diloco serve")

    def call(self, method: str, path: str, *, token: str | None = None,
             json_body: object = None, body: bytes = b"",
             content_type: str | None = None) -> object:  # fmt: skip
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        if json_body is not None:
            body, content_type = json.dumps(json_body).encode(), "application/json"
        if content_type:
            headers["Content-Type"] = content_type
        answer = http_request(self.port, method, path, body=body, headers=headers)
        if answer.status >= 300:
            raise SystemExit(f"{method} {path}: {answer.status} {answer.body[:500]!r}")
        return json.loads(answer.body) if answer.body else None

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            self.process.wait(timeout=60)
        self._log.close()


@contextmanager
def diloco_server(**env: str) -> Iterator[DilocoServer]:
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        server = DilocoServer(Path(tmp), **env)
        try:
            server.wait_ready()
            yield server
        finally:
            server.stop()


def multipart(fields: dict[str, tuple[str | None, bytes, str | None]]) -> tuple[bytes, str]:
    """A multipart/form-data body: name -> (filename or None, bytes, content type)."""
    boundary = "benchboundary7f3a"
    out = bytearray()
    for name, (filename, data, ctype) in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"'.encode()
        if filename is not None:
            out += f'; filename="{filename}"'.encode()
        out += b"\r\n"
        if ctype:
            out += f"Content-Type: {ctype}\r\n".encode()
        out += b"\r\n" + data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


def create_run(server: DilocoServer, *, n_layer: int, n_embd: int, n_head: int,
               quorum: int, data: Path, eval_windows: int = 64,
               compression: str = "int8") -> dict:  # fmt: skip
    config = {
        "name": "bench-transport",
        "model": {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, "block_size": 128},
        "data": {"path": data.name},
        "inner": {"steps": 1},
        "rounds": {"quorum": quorum, "target": quorum, "timeout_s": 3600, "max_rounds": 10},
        "eval": {"windows": eval_windows},  # validation windows the server scores per version
        "compression": {"kind": compression},
        # the bodies are synthetic Δs (random): they lower no loss, so the close's scoring
        # would leave them out (diloco.outer.scoring); the cheap checks still run
        "aggregation": {"score_windows": 0},
        "audit": {"fraction": 0.0},  # nor would they replay: no lease was trained
    }
    body, ctype = multipart({
        "config": (None, json.dumps(config).encode(), None),
        "data": (data.name, data.read_bytes(), "text/plain"),
    })  # fmt: skip
    run = server.call("POST", f"{API}/runs", token=ADMIN, body=body, content_type=ctype)
    assert isinstance(run, dict)
    return run


@dataclass(frozen=True)
class Volunteer:
    token: str
    lease: dict


def join(server: DilocoServer, run_id: str, name: str) -> Volunteer:
    joined = server.call("POST", f"{API}/contributors", json_body={"name": name})
    assert isinstance(joined, dict)
    lease = server.call("POST", f"{API}/runs/{run_id}/join", token=joined["token"], body=b"")
    assert isinstance(lease, dict)
    return Volunteer(joined["token"], lease)


def contribution_body(run_id: str, lease: dict, shapes: dict[str, tuple[int, ...]],
                      seed: int, compression: str = "int8") -> bytes:  # fmt: skip
    """A real contribution body for these shapes (a synthetic Δ) in the ``compression``
    kind at its defaults (int8: blocks of 4096)."""
    import torch

    from diloco.config import CompressionSection
    from diloco.wire.contribution import ContributionMeta, encode_contribution
    from diloco.wire.exchange import encode_delta

    gen = torch.Generator().manual_seed(seed)
    delta = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()}
    encoded, codec, _ = encode_delta(delta, CompressionSection(kind=compression))
    meta = ContributionMeta(run_id, lease["round"], lease["base_version"], 16 * 128, 1, 3.0, codec)
    return b"".join(encode_contribution(meta, encoded, chunk_size=8 << 20))


def upload(server: DilocoServer, run_id: str, volunteer: Volunteer, body: bytes) -> Answer:
    path = f"{API}/runs/{run_id}/rounds/{volunteer.lease['round']}/contribution"
    headers = {"Authorization": f"Bearer {volunteer.token}",
               "Content-Type": "application/octet-stream"}  # fmt: skip
    answer = http_request(server.port, "PUT", path, body=body, headers=headers)
    if answer.status not in (200, 201):
        raise SystemExit(f"upload refused: {answer.status} {answer.body[:500]!r}")
    return answer


def download(server: DilocoServer, url: str, token: str) -> Answer:
    path = url.split("://", 1)[-1]
    path = path[path.index("/") :] if "://" in url else url
    answer = http_request(server.port, "GET", path, headers={"Authorization": f"Bearer {token}"},
                          keep_body=False)  # fmt: skip
    if answer.status != 200:
        raise SystemExit(f"download refused: {answer.status} {answer.body[:500]!r}")
    return answer


def concurrently(n: int, fn: Callable[[int], Answer]) -> list[Answer]:
    results: list[Answer | None] = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as err:  # re-raised below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


# ---------------------------------------------------------------- the report


def line(label: str, figures: list[float], *limits: tuple[str, float], cpu: str = "") -> None:
    med = statistics.median(figures)
    ratios = "".join(f"   {med / lim:5.2f}x {name}" for name, lim in limits)
    spread = f"[{min(figures):.0f}..{max(figures):.0f}]"
    print(f"{label:<44s} {med:8.0f} MB/s {spread:>13s}{ratios}{cpu}", flush=True)


def cpu_note(seconds: float, nbytes: int) -> str:
    return f"   server CPU {seconds / nbytes * 1e9:.2f} ns/byte"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=720)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--uploads", type=int, default=5, help="sequential uploads (the median)")
    ap.add_argument("--concurrent", type=int, default=8, help="uploads at once (peak RSS)")
    ap.add_argument("--downloads", type=int, default=3)
    ap.add_argument("--data", type=Path, default=REPO / "examples/data/shakespeare-excerpt.txt")
    args = ap.parse_args()

    with diloco_server() as server:
        run = create_run(server, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                         quorum=args.uploads + args.concurrent + 1, data=args.data)  # fmt: skip
        run_id = run["id"]
        evals_done(server, 1)  # version 0's eval: not on the CPU while uploads are measured
        first = join(server, run_id, "bench0")
        ckpt = download(server, first.lease["checkpoint"]["url"], first.token)
        shapes = safetensors_shapes(ckpt.body)
        volunteers = [first] + [
            join(server, run_id, f"bench{i}") for i in range(1, args.uploads + args.concurrent)
        ]
        bodies = [contribution_body(run_id, first.lease, shapes, seed=i) for i in range(2)]
        size = len(bodies[0])
        print(f"model: {run['n_params']:,} parameters; int8 contribution body {size:,} bytes; "
              f"checkpoint {ckpt.nbytes:,} bytes", flush=True)  # fmt: skip

        # (a) the kernel's limit; then (b) the HTTP limit and (c) our ingest, one upload
        # of each in turn, so that both see the same load on the machine
        tcp_up = raw_tcp_mbps(size, rounds=args.uploads)
        plain, ingest, plain_cpu, ingest_cpu = [], [], 0.0, 0.0
        with plain_server() as limit:
            for i in range(args.uploads):
                body = reseeded(bodies[i % 2], i)
                cpu = proc_cpu_s(limit.pid)
                plain.append(mbps(size, limit.put(body).seconds))
                plain_cpu += proc_cpu_s(limit.pid) - cpu
                cpu = total_cpu_s(server.pid)  # with its fold process
                ingest.append(mbps(size, upload(server, run_id, volunteers[i], body).seconds))
                ingest_cpu += total_cpu_s(server.pid) - cpu
        line("(a) raw TCP loopback, upload direction", tcp_up)
        line("(b) plain uvicorn httptools+uvloop PUT", plain, ("(a)", statistics.median(tcp_up)),
             cpu=cpu_note(plain_cpu, size * args.uploads))  # fmt: skip
        line("(c) diloco serve ingest, int8 contribution", ingest,
             ("(b)", statistics.median(plain)), ("(a)", statistics.median(tcp_up)),
             cpu=cpu_note(ingest_cpu, size * args.uploads))  # fmt: skip
        med = statistics.median(ingest)
        print(f"goal (issue 29): ingest >= {INGEST_GOAL_MBPS} MB/s per upload (the median): "
              f"{med:.0f} MB/s, {'met' if med >= INGEST_GOAL_MBPS else 'NOT met'} "
              f"(plain uvicorn here {statistics.median(plain):.0f} MB/s)", flush=True)  # fmt: skip

        rest = volunteers[args.uploads :]
        base = rss_mib(server.pid)
        with RssSampler(server.pid) as sampler:
            start = time.perf_counter()
            answers = concurrently(
                len(rest),
                lambda i: upload(server, run_id, rest[i], reseeded(bodies[i % 2], 100 + i)),
            )
            wall = time.perf_counter() - start
        per = [mbps(size, a.seconds) for a in answers]
        total = mbps(size * len(rest), wall)
        print(f"(c) {len(rest)} concurrent uploads: {total:.0f} MB/s in all, "
              f"median {statistics.median(per):.0f} MB/s each; server RSS {base:.0f} MiB before, "
              f"peak {sampler.peak:.0f} MiB (+{sampler.peak - base:.0f} MiB for "
              f"{len(rest)} x {size / 2**20:.0f} MiB in flight)", flush=True)  # fmt: skip

        # (d) the checkpoint, from the server's real route, beside raw TCP sending as much
        nbytes = ckpt.nbytes
        tcp_down = raw_tcp_mbps(nbytes, rounds=args.downloads, send=False)
        down = [
            mbps(nbytes, download(server, first.lease["checkpoint"]["url"], first.token).seconds)
            for _ in range(args.downloads)
        ]
        line("(a) raw TCP loopback, download direction", tcp_down)
        line(f"(d) checkpoint download, {nbytes / 1e6:.0f} MB", down,
             ("(a)", statistics.median(tcp_down)))  # fmt: skip


def reseeded(body: bytes, seed: int) -> bytes:
    """The same body, each upload its own bytes (one payload twice is a replay): the first
    two int8 values become the seed's digits (base 127) and the trailer is recomputed.
    For ingest only: a round's close leaves such near-copies out (``diloco.outer.checks``)."""
    import hashlib

    from diloco.wire.header import DIGEST_BYTES, PREFIX

    (_, header_len) = PREFIX.unpack(body[: PREFIX.size])
    out = bytearray(body[:-DIGEST_BYTES])
    first_data = PREFIX.size + header_len
    out[first_data : first_data + 2] = bytes([seed % 127, seed // 127 % 127])
    out += hashlib.sha256(out).digest()
    return bytes(out)


def safetensors_shapes(start: bytes) -> dict[str, tuple[int, ...]]:
    """The tensor shapes in a safetensors file's header, from the file's first bytes."""
    size = int.from_bytes(start[:8], "little")
    header = json.loads(start[8 : 8 + size])
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


if __name__ == "__main__":
    main()
