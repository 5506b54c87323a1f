"""A thousand uploads to one round of a real server (issue 29, item 6: the second arm).

Does ingest and the fold keep up with volunteers' uploads arriving over a round, and how
long is left after the last one? A fresh database, a real ``diloco serve`` on 127.0.0.1
(its own, without the hub's per-address limits on registrations and uploads: every
volunteer here comes from 127.0.0.1), a run of bench/load.py's ~10.8M-parameter model with
int8 uploads, quorum 1 and target N, every round's deadline ``--round-s`` after it opens.
N contributors register and join. Round 1 takes ``--first`` uploads and closes at its
deadline: that gives the run the norm history a folded round needs (``[aggregation]
reference_min``). Round 2 takes N uploads, one from each volunteer, sent at times spread
evenly over ``--spread-s`` seconds (less than ``--round-s``) as volunteers finishing their
inner steps would, and closes when the N-th is in (its target: the moment a deadline would
be).

Each body is what the client sends (bench/load_support.py's framing: header, tensors,
trailer) with random int8 codes and one scale per block, distinct per volunteer so that no
check takes one for a copy of another (each volunteer's codes are one random draw rotated
by its own offset: a copy is cheap, a draw per body took CPU from the server on the same
two cores); they are made on a thread of this process while the uploads go out, a few
ahead.

Printed: the uploads' answers by status (refused for load: 429, 503, other 5xx, connection
errors), their latency, the upload rate offered and served, the uploads folded as they
arrived (``diloco_folded_uploads_total``, in how many passes) and the close found folded
(``diloco_close_folded_uploads_total``), the fold's time per upload
(``diloco_fold_seconds``), the close's stages (``diloco_round_close_stage_seconds``), and
the time from the N-th upload's answer to the round's ``closed_at`` (its version
published) beside the issue's limit of 5 s; the server's CPU and peak RSS, and its
child processes' (the fold's: ``server.rounds.folding.FoldProcess``).

With ``--model 1B`` it is issue 29's 1B arm (16 uploads of 1 GB; see ``MODELS`` for its
limits): the time from the last upload to the full files durable, and the server's peak
RSS over its idle RSS, are printed beside them.

    python bench/arrivals.py [--volunteers 1000] [--spread-s 100] [--round-s 130]
                             [--database-url postgresql://...] [--json out.json]
    python bench/arrivals.py --volunteers 16 --first 3 --spread-s 160 --round-s 320 \
                             --model 1B                   # ~10 min, 60 GB of disk
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import MODEL, SMALL_MODEL, run_async, server_errors
from load_support import (
    API,
    Recorder,
    create_run,
    fresh_database,
    http_session,
    lease_frame,
    server,
    summarize,
)
from procstat import rss_mib, tree_cpu_s

REFUSED = ("429", "503")  # what a server refusing for load answers
# the models, and issue 29's limits on each: deadline (the last upload in) -> delta
# published; the full files durable after it; the server's peak RSS over its idle RSS
MODELS: dict[str, dict[str, Any]] = {
    "10M": {"model": MODEL, "publish_s": 5.0},
    "small": {"model": SMALL_MODEL, "publish_s": 5.0},
    # 1B with 16 uploads: published <= 20 s, full files <= 2 min, <= 2 GiB over idle; its
    # version eval on 4 windows (the default's 64 take minutes of a core at this size)
    "1B": {
        "model": {"n_layer": 20, "n_head": 16, "n_embd": 2048, "block_size": 128},
        "publish_s": 20.0,
        "full_s": 120.0,
        "rss_over_mib": 2048.0,
        "eval_windows": 4,
        # the server's default close budget takes it (diloco.outer.memory: 4.4 GiB at 1B,
        # under half the default's 11.8 GiB; 8.1 GiB while the evals held a model copy)
    },
}


def body_maker(lease: dict[str, Any]) -> Any:
    """``make(i)``: volunteer i's body for ``lease``'s round (random int8 codes, one scale
    per block, framed as the client frames an upload)."""
    import torch

    from diloco.wire.codec import EncodedTensor
    from diloco.wire.contribution import encode_contribution
    from diloco.wire.exchange import codec_for

    cfg, shapes, meta = lease_frame(lease)
    codec = codec_for(cfg.compression)
    total = sum(math.prod(shape) for shape in shapes.values())
    # one draw of random codes, each volunteer's a rotation of it (a copy, not a second
    # draw: the bench's own CPU is taken from the server's two cores)
    codes = torch.randint(
        -127, 128, (total,), dtype=torch.int8, generator=torch.Generator().manual_seed(1000)
    )

    def make(i: int) -> bytes:
        mine = torch.roll(codes, 7919 * (i + 1))
        encoded, at = {}, 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            scales = torch.full((codec.n_scales(n),), 1e-5 * (1 + i % 7 / 10))
            encoded[name] = EncodedTensor(shape, mine[at : at + n], scales)
            at += n
        return b"".join(encode_contribution(meta, encoded))

    return make


async def enlist(http: aiohttp.ClientSession, rec: Recorder, run_id: str, n: int) -> list[dict]:
    """Register n contributors, 32 at a time; their auth headers."""
    gate = asyncio.Semaphore(32)

    async def one(i: int) -> dict[str, str]:
        async with gate:
            status, body = await rec.call(
                http, "POST", f"{API}/contributors", "register", json={"name": f"a{i}"}
            )
            if status != 201:
                raise SystemExit(f"register answered {status}: {body}")
            return {"Authorization": f"Bearer {body['token']}"}

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def join_all(
    http: aiohttp.ClientSession, rec: Recorder, run_id: str, auths: list[dict], round_: int
) -> list[dict[str, Any]]:
    """Every volunteer's lease on round ``round_``, 32 joins at a time (a join answered
    otherwise is tried again a second later, up to a minute)."""
    gate = asyncio.Semaphore(32)

    async def one(auth: dict[str, str]) -> dict[str, Any]:
        give_up = time.time() + 60
        while time.time() < give_up:
            async with gate:
                status, body = await rec.call(
                    http, "POST", f"{API}/runs/{run_id}/join", "join", headers=auth
                )
            if status == 200 and body["round"] == round_:
                return dict(body)
            await asyncio.sleep(1.0)
        raise SystemExit(f"no lease on round {round_} within a minute: {status} {body}")

    return list(await asyncio.gather(*(one(a) for a in auths)))


async def upload(
    http: aiohttp.ClientSession, rec: Recorder, run_id: str, auth: dict, round_: int, body: bytes
) -> None:
    await rec.call(
        http, "PUT", f"{API}/runs/{run_id}/rounds/{round_}/contribution", "upload", data=body,
        timeout=aiohttp.ClientTimeout(total=300, connect=10),
        headers={**auth, "Content-Type": "application/octet-stream"},
    )  # fmt: skip


async def spread_uploads(
    http: aiohttp.ClientSession, rec: Recorder, run_id: str, auths: list[dict],
    lease: dict[str, Any], spread_s: float,
) -> float:  # fmt: skip
    """Volunteer i uploads at i x spread_s / N from now, its body made a few ahead on a
    thread; returns when every answer is in."""
    make = body_maker(lease)
    n, loop = len(auths), asyncio.get_running_loop()
    ready: asyncio.Queue[bytes] = asyncio.Queue(maxsize=4)

    async def produce() -> None:
        for i in range(n):
            await ready.put(await asyncio.to_thread(make, i))

    producer = asyncio.create_task(produce())
    start, sent = loop.time(), []
    for i, auth in enumerate(auths):
        await asyncio.sleep(max(0.0, start + i * spread_s / n - loop.time()))
        body = await ready.get()
        sent.append(asyncio.create_task(upload(http, rec, run_id, auth, lease["round"], body)))
    await producer
    await asyncio.gather(*sent)
    return loop.time() - start


async def wait_closed(
    http: aiohttp.ClientSession, rec: Recorder, run_id: str, round_: int, timeout: float
) -> float | None:
    """Round ``round_``'s closed_at as a timestamp, polled every 0.2 s; None if not closed."""
    give_up = time.time() + timeout
    while time.time() < give_up:
        status, body = await rec.call(http, "GET", f"{API}/runs/{run_id}/rounds", "poll")
        if status == 200:
            for r in body["rounds"]:
                if r["index"] == round_ and r["state"] == "closed":
                    return float(datetime_ts(r["closed_at"]))
        await asyncio.sleep(0.2)
    return None


async def settle(http: aiohttp.ClientSession, run_id: str, timeout: float = 1800) -> None:
    """Wait (polled every second) until the latest version's eval is filled in."""
    give_up = time.time() + timeout
    while time.time() < give_up:
        async with http.get(f"{API}/runs/{run_id}/rounds") as r:
            closed = [x for x in (await r.json())["rounds"] if x["state"] == "closed"]
        if closed and all(x.get("eval_loss") is not None for x in closed):
            return
        await asyncio.sleep(1.0)
    raise SystemExit("the latest version's eval did not finish")


async def full_files(
    http: aiohttp.ClientSession, before: dict[str, float], timeout: float
) -> float | None:
    """When the round's full files (parameters, outer state) were durable: the time the
    close's ``to_full`` stage was first counted past ``before``'s, polled every 0.2 s."""
    key = 'diloco_round_close_stage_seconds_count{stage="to_full"}'
    give_up = time.time() + timeout
    while time.time() < give_up:
        if (await metrics(http)).get(key, 0.0) > before.get(key, 0.0):
            return time.time()
        await asyncio.sleep(0.2)
    return None


def datetime_ts(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text).timestamp()


async def metrics(http: aiohttp.ClientSession) -> dict[str, float]:
    """The server's /metrics samples this bench reads, by name and labels."""
    async with http.get("/metrics") as r:
        text = await r.text()
    wanted = re.compile(
        r"^(diloco_(?:close_folded_uploads_total|folded_uploads_total|fold_seconds_(?:sum|count)"
        r"|round_close_stage_seconds_(?:sum|count)|round_close_seconds_sum|uploads_total)"
        r"(?:\{[^}]*\})?)"
        r" ([0-9.eE+-]+)$",
        re.M,
    )
    return {m[1]: float(m[2]) for m in wanted.finditer(text)}


async def bench(args: argparse.Namespace, base: str, pid: int) -> dict[str, Any]:
    rec, n = Recorder(), args.volunteers
    out: dict[str, Any] = {"volunteers": n, "spread_s": args.spread_s, "model": args.model}
    async with http_session(base, n + 64) as http:
        rounds = {
            "quorum": 1,
            "target": n,
            "timeout_s": args.round_s,  # round 1's close; round 2 reaches its target first
            "max_rounds": 10,
            "heartbeat_interval_s": 600,  # leases outlive the bench: no heartbeats needed
            "lease_ttl_s": 3600,
        }
        arm = MODELS[args.model]
        extra = {"eval": {"windows": arm["eval_windows"]}} if "eval_windows" in arm else {}
        run = await create_run(http, rec, f"arrivals-{n}", arm["model"], rounds, extra)
        out["n_params"] = run["n_params"]
        auths = await enlist(http, rec, run["id"], n)
        first = await join_all(http, rec, run["id"], auths[: args.first], 1)
        make = body_maker(first[0])
        await asyncio.gather(
            *(
                upload(http, rec, run["id"], a, 1, make(i))
                for i, a in enumerate(auths[: args.first])
            )
        )
        if await wait_closed(http, rec, run["id"], 1, args.round_s + 120) is None:
            raise SystemExit("round 1 did not close")
        leases = await join_all(http, rec, run["id"], auths, 2)
        rec.samples.clear()
        await settle(http, run["id"])  # version 1's eval done: the server idle again
        out["server_idle_rss_mib"] = rss_mib(pid)
        for p in tree_cpu_s(pid):  # peak RSS from here (VmHWM), the fold's process too
            Path(f"/proc/{p}/clear_refs").write_text("5")
        before, cpu0 = await metrics(http), tree_cpu_s(pid)
        out["uploads_s"] = await spread_uploads(
            http, rec, run["id"], auths, leases[0], args.spread_s
        )
        ups = [s for s in rec.samples if s.kind == "upload"]
        last = max(s.sent + s.latency for s in ups)
        closed = await wait_closed(http, rec, run["id"], 2, args.close_timeout_s)
        out["server_peak_rss_mib"] = rss_mib(pid, "VmHWM")  # before version 2's eval
        full = await full_files(http, before, args.close_timeout_s)
        out["full_after_last_s"] = None if full is None else full - last
        after = await metrics(http)
        cpu = {p: s - cpu0.get(p, 0.0) for p, s in tree_cpu_s(pid).items()}
        out["server_cpu_s"] = cpu.pop(pid)
        out["children_cpu_s"] = sum(cpu.values())  # its fold process
        out["children_peak_rss_mib"] = sum(rss_mib(p, "VmHWM") for p in cpu)
        out["upload_bytes"] = len(make(0))
        out["uploads"] = summarize(ups, set())
        out["close_after_last_s"] = None if closed is None else closed - last
        out["metrics"] = {k: after[k] - before.get(k, 0.0) for k in after}
    return out


def report(r: dict[str, Any]) -> None:
    u, m, arm = r["uploads"], r["metrics"], MODELS[r["model"]]
    n, mb = r["volunteers"], r["upload_bytes"] / 1e6
    print(f"{n} uploads of {mb:.1f} MB ({r['n_params']:,} parameters) over {r['uploads_s']:.1f} s "
          f"(offered {n / r['spread_s']:.1f}/s, {n * mb / r['spread_s']:.0f} MB/s)")  # fmt: skip
    refused = {k: v for k, v in u["errors"].items() if k.split()[0] in REFUSED}
    print(f"  answered 2xx: {u['ok']} of {u['count']}; errors {u['errors'] or 'none'}; "
          f"latency p50 {u['p50_ms']:.0f} ms, p99 {u['p99_ms']:.0f} ms")  # fmt: skip
    passes = m.get("diloco_fold_seconds_count", 0.0)
    folds = m.get("diloco_folded_uploads_total", 0.0)
    per = m.get("diloco_fold_seconds_sum", 0.0) / folds if folds else float("nan")
    found = m.get("diloco_close_folded_uploads_total", 0.0)
    print(f"  folded as they arrived: {folds:.0f} in {passes:.0f} passes (the close found "
          f"{found:.0f} folded); {per:.3f} s an upload")  # fmt: skip
    stages = {
        re.search(r'stage="([^"]+)"', k)[1]: v  # type: ignore[index]
        for k, v in m.items()
        if k.startswith("diloco_round_close_stage_seconds_sum") and v > 0
    }
    print("  close stages: " + ", ".join(f"{s} {v:.2f} s" for s, v in stages.items()))
    over = r["server_peak_rss_mib"] - r["server_idle_rss_mib"]
    print(f"  server CPU {r['server_cpu_s']:.1f} s over the round, its child processes' (the "
          f"fold's) {r['children_cpu_s']:.1f} s; peak RSS {r['server_peak_rss_mib']:.0f} MiB "
          f"({over:.0f} over idle, until published), children {r['children_peak_rss_mib']:.0f} "
          "MiB")  # fmt: skip
    after, full = r["close_after_last_s"], r["full_after_last_s"]
    if after is None:
        print("  the round did not close: NOT met")
        return
    ok = after <= arm["publish_s"] and u["ok"] == u["count"] and not refused
    print(f"  last upload answered -> version published: {after:.2f} s (limit "
          f"{arm['publish_s']:.0f} s), {sum(refused.values())} refused for load: "
          f"{'met' if ok else 'NOT met'}")  # fmt: skip
    if "full_s" in arm:
        ok = full is not None and full <= arm["full_s"]
        shown = "never" if full is None else f"{full:.1f} s"
        print(f"  last upload answered -> full files durable: {shown} (limit "
              f"{arm['full_s']:.0f} s): {'met' if ok else 'NOT met'}")  # fmt: skip
    if "rss_over_mib" in arm:
        ok = over + r["children_peak_rss_mib"] <= arm["rss_over_mib"]
        print(f"  peak RSS over idle, the server and its fold's process: "
              f"{over + r['children_peak_rss_mib']:.0f} MiB (limit {arm['rss_over_mib']:.0f} "
              f"MiB): {'met' if ok else 'NOT met'}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--volunteers", type=int, default=1000)
    ap.add_argument("--spread-s", type=float, default=100.0, help="round 2's uploads over this")
    ap.add_argument("--round-s", type=float, default=130.0, help="each round's deadline")
    ap.add_argument("--first", type=int, default=4, help="round 1's uploads (the history)")
    ap.add_argument("--close-timeout-s", type=float, default=300.0)
    ap.add_argument("--model", choices=sorted(MODELS), default="10M",
                    help="small: a tiny model (smoke tests); 1B: issue 29's 1B arm")  # fmt: skip
    ap.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.spread_s >= args.round_s:
        ap.error("--spread-s must be shorter than --round-s: round 2 closes at its target")
    env = {"DILOCO_RATE_REGISTER": "", "DILOCO_RATE_UPLOAD": ""}  # all from 127.0.0.1
    env.update(MODELS[args.model].get("env", {}))
    with (
        tempfile.TemporaryDirectory(prefix="diloco-arrivals-") as tmp,
        fresh_database(args.database_url) as db,
        server(Path(tmp) / "srv", db[1], env=env) as (base, pid),
    ):
        result = run_async(bench(args, base, pid))
        result["server_errors"] = server_errors(Path(tmp) / "srv" / "server.log")
    report(result)
    if result["server_errors"]:
        print(f"  server errors: {result['server_errors']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
