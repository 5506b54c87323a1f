"""Server CPU-seconds per round with direct transfers against proxied, same run, same machine.

For each mode it starts a real ``diloco serve`` (embedded Postgres, or the database in
DILOCO_BENCH_DATABASE_URL), creates a run of the chosen size (default 50M parameters),
and plays one round with K volunteers (default 8) over loopback HTTP:

- proxied: local storage; every byte goes through the server (lease URLs are server
  paths, fetched with the contributor's token; the contribution is a PUT to the server);
- direct: ``--storage s3://…`` on a real S3 API server (SeaweedFS ``weed mini``, started
  by this bench on 127.0.0.1); the lease's checkpoint and shard URLs are signed GETs on
  the bucket (fetched without a token), the contribution is a signed PUT to the bucket and
  then a POST of the commit URL to the server.

Stages, each timed (wall) and charged (CPU-seconds of the ``diloco serve`` Python process,
read from /proc; its embedded Postgres is not counted, in either mode):

1. join + download: K joins, each volunteer GETs the checkpoint and its shard;
2. upload: K contributions (synthetic int8 Δs, no training); in direct mode the PUT to the
   bucket and the commit are charged separately;
3. close: from the K-th receipt until version 1 is published;
4. eval: until version 1's eval loss is filled in.

The S3 server's own CPU-seconds (every process of ``weed mini``) are reported on their own
line: in direct mode the bytes move between the volunteers and the bucket, so the cost
moves there too; it is shown, not hidden. The server's /metrics give the blob bytes it
sent and received over HTTP and the redirects it answered.

Where direct costs the server *more*: the commit reads the whole object back from the
bucket to check it (the same checks as a proxied PUT, fed from a GET instead of the
request body), then copies it inside the bucket; the close fetches the K uploads (and the
base version, unless this worker kept it: server.storage.staging.FileCache) from the bucket into a
scratch folder and puts the new version's three files back, where on local storage it
reads and writes the files in place. The bench's one round starts from version 0, which
the worker created and so kept; the eval's checkpoint is the one the close just put, kept
too. Every one of those bytes goes through boto3 in the server's Python process (bodies
unsigned, with botocore's CRC32: ``server.storage.s3.make_client``). Those costs are
printed per stage, and the last line says whether direct costs the server less CPU than
proxied at this many volunteers (issue 29's goal) and from how many on. The S3
server shares this machine's cores with the server, so direct wall times here include
waiting for it; a real bucket is elsewhere.

    python bench/direct_transfers.py [--size 50M --contributions 8]
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.loopback import Answer, http_request  # noqa: E402
from bench.procstat import total_cpu_s  # noqa: E402
from bench.server_metrics import evals_done, metric_count, metric_sums, metrics, poll  # noqa: E402
from bench.server_round import SIZES  # noqa: E402
from bench.transport import (  # noqa: E402
    ADMIN,
    API,
    DilocoServer,
    Volunteer,
    contribution_body,
    create_run,
    diloco_server,
    download,
    join,
    safetensors_shapes,
    upload,
)
from tests.support.s3 import S3Server  # noqa: E402

EVAL_WINDOWS = 16
# the close's and the eval's ends are polled this often: each poll (GET /runs/{id}, or
# /metrics for the eval) costs the server CPU, which the stage is charged; every 0.1 s
# (before issue 29) that was ~40 ms of server CPU a second, more in the mode whose close
# takes longer
WAIT_POLL_S = 0.5
IDLE_S = 3.0  # the server's idle CPU rate is measured this long before the round
STAGES = ("join + download", "upload: PUT body", "upload: commit", "close", "eval")


@dataclass
class Meter:
    """Wall and CPU-seconds per stage, of the server and (if any) of the S3 server."""

    server_pid: int
    s3_pid: int | None
    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    s3_cpu: dict[str, float] = field(default_factory=dict)

    def charge(self, stage: str, fn: Callable[[], object]) -> object:
        start, cpu = time.perf_counter(), total_cpu_s(self.server_pid)
        s3 = total_cpu_s(self.s3_pid) if self.s3_pid else 0.0
        try:
            return fn()
        finally:
            self.wall[stage] = self.wall.get(stage, 0.0) + time.perf_counter() - start
            self.cpu[stage] = self.cpu.get(stage, 0.0) + total_cpu_s(self.server_pid) - cpu
            if self.s3_pid:
                spent = total_cpu_s(self.s3_pid) - s3
                self.s3_cpu[stage] = self.s3_cpu.get(stage, 0.0) + spent


def absolute(url: str) -> tuple[int, str]:
    """The port and path (with the signature's query) of an absolute loopback URL."""
    parts = urlsplit(url)
    if parts.hostname != "127.0.0.1" or parts.port is None:
        raise SystemExit(f"expected a loopback URL, got {url}")
    return parts.port, parts.path + (f"?{parts.query}" if parts.query else "")


def fetch(server: DilocoServer, url: str, token: str) -> Answer:
    """Follow a lease URL: a server path with the token, a signed URL without one."""
    if "://" not in url:
        return download(server, url, token)
    port, path = absolute(url)
    answer = http_request(port, "GET", path, keep_body=False)
    if answer.status != 200:
        raise SystemExit(f"bucket GET refused: {answer.status} {answer.body[:300]!r}")
    return answer


def put_direct(server: DilocoServer, volunteer: Volunteer, body: bytes, meter: Meter) -> None:
    target = volunteer.lease["upload"]
    port, path = absolute(target["url"])

    def put() -> None:
        headers = {"Content-Type": "application/octet-stream"}
        answer = http_request(port, "PUT", path, body=body, headers=headers)
        if answer.status != 200:
            raise SystemExit(f"bucket PUT refused: {answer.status} {answer.body[:300]!r}")

    meter.charge("upload: PUT body", put)
    meter.charge("upload: commit", lambda: server.call("POST", target["commit_url"],
                                                       token=volunteer.token))  # fmt: skip


def counters(server: DilocoServer) -> dict[str, float]:
    """The blob byte and redirect counters of /metrics (name{labels} -> value)."""
    out = {}
    text = metrics(server)
    names = ("diloco_served_bytes_total", "diloco_upload_bytes_total",
             "diloco_direct_upload_bytes_total", "diloco_redirects_total")  # fmt: skip
    for m in re.finditer(r"^(\w+)(\{[^}]*\})? (\S+)$", text, re.M):
        if m.group(1) in names:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


@dataclass
class Round:
    mode: str
    n_params: int
    body_bytes: int
    meter: Meter
    sent: dict[str, float]  # /metrics counters over the round
    close_s: float  # the server's own clocks (/metrics): the close's critical path,
    close_stages: dict[str, float]  # its stages,
    eval_s: float  # and version 1's eval
    idle_rate: float  # server CPU-s per second while nothing happens (its sweeps), before


def play_round(mode: str, shape: tuple[int, int, int], k: int, data: Path,
               shapes: dict[str, tuple[int, ...]] | None, s3: S3Server | None,
               scratch: Path) -> tuple[Round, dict[str, tuple[int, ...]]]:  # fmt: skip
    n_layer, n_embd, n_head = shape
    # the server's own sweep interval (1 s): an upload and a finished close wake its sweeper
    # at once, so the round's events do not wait for it (every 0.2 s, as before 2026-11-29,
    # cost the idle server 40 ms of CPU a second, charged most to the mode that lasts longest)
    env = {"DILOCO_RATE_REGISTER": "", "DILOCO_RATE_UPLOAD": ""}
    if s3 is not None:
        env |= s3.env() | {"DILOCO_STORAGE": f"s3://{s3.bucket}/bench-{secrets.token_hex(4)}",
                           "DILOCO_SCRATCH_DIR": str(scratch)}  # fmt: skip
    with diloco_server(**env) as server:
        run = create_run(server, n_layer=n_layer, n_embd=n_embd, n_head=n_head, quorum=k,
                         data=data, eval_windows=EVAL_WINDOWS)  # fmt: skip
        run_id = run["id"]
        if shapes is None:  # proxied: the checkpoint route serves it (not measured)
            ckpt = download(server, f"{API}/runs/{run_id}/checkpoints/0", ADMIN)
            shapes = safetensors_shapes(ckpt.body)
        lease = {"round": 1, "base_version": 0}  # each its own Δ: the close leaves copies out
        bodies = [contribution_body(run_id, lease, shapes, seed=i) for i in range(k)]
        # version 0's eval runs after run creation: let it finish before the round
        evals_done(server, 1)
        before = counters(server)
        version0_eval = metric_sums(metrics(server), "diloco_version_eval_seconds")[""]
        idle = total_cpu_s(server.pid)
        time.sleep(IDLE_S)  # what the server spends doing nothing (its sweeps): per second
        idle_rate = (total_cpu_s(server.pid) - idle) / IDLE_S
        meter = Meter(server.pid, s3.pid if s3 else None)
        volunteers: list[Volunteer] = []

        def join_and_download() -> None:
            for i in range(k):
                v = join(server, run_id, f"{mode}{i}")
                assert (v.lease["upload"] is None) == (s3 is None), v.lease["upload"]
                fetch(server, v.lease["checkpoint"]["url"], v.token)
                fetch(server, v.lease["shard"]["url"], v.token)
                volunteers.append(v)

        meter.charge("join + download", join_and_download)
        for v, body in zip(volunteers, bodies, strict=True):
            if s3 is None:
                meter.charge("upload: PUT body", lambda v=v, b=body: upload(server, run_id, v, b))
            else:
                put_direct(server, v, body, meter)

        def published() -> object:
            run_now = server.call("GET", f"{API}/runs/{run_id}")
            return isinstance(run_now, dict) and run_now["checkpoint_version"] == 1

        meter.charge("close", lambda: poll(published, 900, "round 1 to close", WAIT_POLL_S))
        meter.charge("eval", lambda: poll(
            lambda: metric_count(metrics(server), "diloco_version_eval_seconds") >= 2, 900,
            "version 1's eval", WAIT_POLL_S))  # fmt: skip
        after = counters(server)
        text = metrics(server)
    sent = {name: after[name] - before.get(name, 0.0) for name in after}
    close_s = metric_sums(text, "diloco_round_close_seconds")[""]
    stages = metric_sums(text, "diloco_round_close_stage_seconds")
    evals = metric_sums(text, "diloco_version_eval_seconds")[""]
    eval_s = evals - version0_eval
    result = Round(
        mode, run["n_params"], len(bodies[0]), meter, sent, close_s, stages, eval_s, idle_rate
    )
    return result, shapes


# ---------------------------------------------------------------- the report


def ratio(direct: float, proxied: float) -> str:
    return f"{direct / proxied:.2f}" if proxied > 0 else "—"


# (row, the meter's stages it sums); why direct may cost the server more there
ROWS = (
    ("join + download", ("join + download",)),
    ("upload, in all", ("upload: PUT body", "upload: commit")),
    ("  of which PUT body", ("upload: PUT body",)),
    ("  of which commit", ("upload: commit",)),
    ("close", ("close",)),
    ("eval", ("eval",)),
)
WHY = {
    "join + download": "signing two URLs per lease",
    "upload, in all": "the commit GETs each body back from the bucket, checks it as a "
    "proxied PUT is checked, and copies it inside the bucket",
    "close": "the uploads (and the base version, unless this worker kept it) are fetched "
    "from the bucket into a scratch folder and the new version's three files are put back "
    "(server.storage.staging)",
    "eval": "the new checkpoint is fetched from the bucket again (unless this worker kept it)",
}


def summed(values: dict[str, float], stages: tuple[str, ...]) -> float | None:
    found = [values[s] for s in stages if s in values]
    return sum(found) if found else None


def cell(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def report(label: str, k: int, proxied: Round, direct: Round) -> None:
    p, d = proxied.meter, direct.meter
    print(f"\n## {label}: {proxied.n_params:,} parameters, {k} contributions of "
          f"{proxied.body_bytes:,} B\n")  # fmt: skip
    print("| stage | proxied: server CPU-s | direct: server CPU-s | direct / proxied "
          "| direct: S3 server CPU-s | proxied wall s | direct wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    slower = []
    for row, stages in ROWS:
        pc, dc = summed(p.cpu, stages), summed(d.cpu, stages)
        if pc is not None and dc is not None and dc > pc and row in WHY:
            slower.append(f"{row} ({dc:.2f} s against {pc:.2f} s: {WHY[row]})")
        r = ratio(dc, pc) if pc is not None and dc is not None else "—"
        print(f"| {row} | {cell(pc)} | {cell(dc)} | {r} | "
              f"{cell(summed(d.s3_cpu, stages))} | {cell(summed(p.wall, stages))} | "
              f"{cell(summed(d.wall, stages))} |")  # fmt: skip
    pt, dt, st = sum(p.cpu.values()), sum(d.cpu.values()), sum(d.s3_cpu.values())
    print(
        f"| **whole round** | **{pt:.2f}** | **{dt:.2f}** | **{ratio(dt, pt)}** | "
        f"**{st:.2f}** | {sum(p.wall.values()):.2f} | {sum(d.wall.values()):.2f} |"
    )
    print(f"\nratio: direct / proxied server CPU-seconds per round = {ratio(dt, pt)} "
          f"({dt:.2f} s against {pt:.2f} s); with the S3 server's CPU added, direct costs "
          f"{dt + st:.2f} s ({ratio(dt + st, pt)} of proxied)")  # fmt: skip
    for line in slower:
        print(f"direct costs the server MORE CPU in {line}")
    # what grows with the volunteers (joins, downloads, uploads) and what does not
    stages = ("join + download", "upload: PUT body", "upload: commit")
    fixed = ("close", "eval")
    per = [(summed(m.cpu, stages) or 0.0) / k for m in (p, d)]
    once = [summed(m.cpu, fixed) or 0.0 for m in (p, d)]
    print(
        f"per volunteer: proxied {per[0]:.3f} s, direct {per[1]:.3f} s of server CPU "
        f"({ratio(per[1], per[0])}); per round, whatever the volunteers: proxied "
        f"{once[0]:.2f} s, direct {once[1]:.2f} s (close + eval, {ratio(once[1], once[0])})"
    )
    if once[1] <= once[0]:
        even = "from the first volunteer (close + eval cost direct no more)"
    elif per[1] < per[0]:
        even = f"from {(once[1] - once[0]) / (per[0] - per[1]):.1f} volunteers a round on"
    else:
        even = "never (direct costs more per volunteer too)"
    print(
        f"goal (issue 29): direct costs the server less CPU than proxied at {k} volunteers: "
        f"{dt:.2f} s against {pt:.2f} s ({ratio(dt, pt)}), {'met' if dt < pt else 'NOT met'}; "
        f"direct costs the server less {even}"
    )
    print(
        f"(the close stage ends when version 1 is seen published, polled every "
        f"{WAIT_POLL_S:g} s: the eval, which starts at publishing, may begin inside it)"
    )
    rates = ", ".join(
        f"{r.mode} {r.idle_rate * 1e3:.0f} ms/s, {r.idle_rate * sum(r.meter.wall.values()):.2f} s "
        f"over its {sum(r.meter.wall.values()):.1f} s"
        for r in (proxied, direct)
    )
    print(
        f"(the server's idle CPU, its periodic sweeps, is in every stage for as long as the "
        f"stage lasts: {rates})"
    )
    for r in (proxied, direct):
        stages = ", ".join(f"{s} {v:.2f}" for s, v in r.close_stages.items())
        print(f"{r.mode}: the server's own clock: close {r.close_s:.2f} s ({stages}); "
              f"eval {r.eval_s:.2f} s")  # fmt: skip
    print("\n| blob bytes over the server's HTTP (/metrics, over the round) | proxied | direct |")
    print("|---|---|---|")
    for name in sorted(set(proxied.sent) | set(direct.sent)):
        a, b = proxied.sent.get(name, 0.0), direct.sent.get(name, 0.0)
        if a or b:
            print(f"| {name} | {a:,.0f} | {b:,.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="50M", choices=sorted(SIZES))
    ap.add_argument("--contributions", type=int, default=8)
    ap.add_argument("--data", type=Path, default=REPO / "examples/data/shakespeare-excerpt.txt")
    args = ap.parse_args()
    shape, k = SIZES[args.size], args.contributions
    with tempfile.TemporaryDirectory(prefix="diloco-bench-direct-") as tmp:
        root = Path(tmp)
        proxied, shapes = play_round("proxied", shape, k, args.data, None, None, root)
        print(f"proxied round done: server CPU {sum(proxied.meter.cpu.values()):.2f} s",
              flush=True)  # fmt: skip
        s3 = S3Server(root / "s3")
        try:
            s3.wait_ready()
            idle = total_cpu_s(s3.pid)
            direct, _ = play_round("direct", shape, k, args.data, shapes, s3, root / "scratch")
            print(f"direct round done: server CPU {sum(direct.meter.cpu.values()):.2f} s; "
                  f"S3 server {total_cpu_s(s3.pid) - idle:.2f} s since ready "
                  f"(run creation included)", flush=True)  # fmt: skip
        finally:
            s3.stop()
    report(args.size, k, proxied, direct)
    print(
        f"\n(server CPU: the diloco serve process and its child processes (the fold's), "
        f"user + system from /proc; {os.cpu_count()} cores on this machine, shared: ratios "
        "hold, seconds do not)"
    )


if __name__ == "__main__":
    main()
