"""What bench/load.py prints: one block per N, then the goals, each said met or not."""

from __future__ import annotations

from typing import Any

ROWS = [  # (phase, request kind) in the order a person reads them
    ("idle", "heartbeat"),
    ("idle", "healthz"),
    ("upload", "heartbeat"),
    ("upload", "upload"),
    ("upload", "join"),
    ("close", "heartbeat"),
    ("close", "join"),
    ("after", "join"),
    ("after", "heartbeat"),
]


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) or "0"


def _row(phase: str, kind: str, s: dict[str, Any]) -> str:
    return (
        f"{phase:<7s} {kind:<10s} {s['count']:>7d} {s['ok']:>7d} {s['p50_ms']:>8.1f} "
        f"{s['p95_ms']:>8.1f} {s['p99_ms']:>8.1f} {s['max_ms']:>8.1f}  "
        f"{_counts(s['protocol_409s']):<34s} {_counts(s['errors'])}"
    )


def print_one(r: dict[str, Any], goal: dict[str, float]) -> None:
    n, offered = r["volunteers"], r["offered_per_s"]
    advised = ", ".join(f"{k} s: {v}" for k, v in r["advised_s"].items())
    print(
        f"\n== N = {n} volunteers; the run's heartbeat interval {r['interval_s']:g} s, the "
        f"server advised ({advised} volunteers): {offered:,.1f}/s offered; model "
        f"{r['n_params']:,} parameters; uploads of {r['upload_bytes'] / 1e6:.1f} MB"
    )
    setup = r["setup"]
    j = setup["join"]
    print(
        f"setup: {n} registered and joined in {setup['seconds']:.1f} s "
        f"({setup['concurrency']} requests in flight): join p50 {j['p50_ms']:.1f}  "
        f"p95 {j['p95_ms']:.1f}  p99 {j['p99_ms']:.1f}  max {j['max_ms']:.1f} ms; "
        f"errors {_counts(j['errors'])}; register errors "
        f"{_counts(setup['register']['errors'])}"
    )
    print(
        f"{'phase':<7s} {'request':<10s} {'count':>7s} {'2xx':>7s} {'p50 ms':>8s} "
        f"{'p95 ms':>8s} {'p99 ms':>8s} {'max ms':>8s}  {'protocol 409s':<34s} errors"
    )
    for phase, kind in ROWS:
        s = r["phases"][phase].get(kind)
        if s and s["count"]:
            print(_row(phase, kind, s))
    windows = ", ".join(f"{p} {r['phases'][p]['seconds']:.1f} s" for p in r["phases"])
    print(f"windows (by send time): {windows}")

    lag = r["server_loop_lag"]
    print(
        f"idle: the server's event loop ran its timers late by at most {lag['p50_le_s']:g} s "
        f"(p50), {lag['p99_le_s']:g} s (p99), {lag['max_le_s']:g} s (all) of "
        f"{lag['samples']:.0f} samples (diloco_event_loop_lag_seconds buckets)"
    )
    idle = r["idle_resources"]
    secs = idle["seconds"]
    served = r["phases"]["idle"]["heartbeat"]["ok"]
    low, high = r["offered_range_per_s"]
    warm = "" if r["warmed_up"] else " (NOT every volunteer had heard the advice)"
    print(
        f"idle: served {r['served_per_s']:,.1f}/s of {r['offered_per_s']:,.1f}/s offered "
        f"({low:,.1f} at its start, {high:,.1f} at its end; warm-up {r['warm_up_s']:.1f} s"
        f"{warm}); load generator late by {r['lag_p99_ms']:.1f} ms at p99"
    )
    print(
        f"idle: server CPU {idle['server_cpu_s'] / secs:.2f} s/s "
        f"({served / max(idle['server_cpu_s'], 1e-9):,.0f} heartbeats per server CPU-second"
        f", {1000 * idle['server_cpu_s'] / max(served, 1):.2f} ms each); Postgres backends "
        f"{idle['postgres_cpu_s'] / secs:.2f} s/s "
        f"({1000 * idle['postgres_cpu_s'] / max(served, 1):.2f} ms"
        f" per heartbeat); ≈{idle['transactions'] / max(served, 1):.1f} transactions per "
        f"heartbeat; load generator {idle['generator_cpu_s'] / secs:.2f} s/s; server RSS "
        f"peak {idle['rss_peak_mib']:.0f} MiB"
    )
    close = r["close_resources"]
    if r["round_closed"]:
        print(
            f"close: the round closed {r['close_seconds']:.1f} s after the last upload's "
            f"answer; server CPU {close['server_cpu_s']:.1f} s over uploads + close "
            f"({close['seconds']:.1f} s); server RSS peak {close['rss_peak_mib']:.0f} MiB"
        )
    else:
        print("close: THE ROUND DID NOT CLOSE within the timeout")
    lim = r["limits"]
    fl, hz, pg = lim["floor"], lim["healthz"], lim["asyncpg_update"]
    print(
        f"limits at {offered:,.0f} requests/s: unmatched route (404, no database) "
        f"{fl['per_server_cpu_s']:,.0f}/server CPU-s, p99 {fl['p99_ms']:.1f} ms, errors "
        f"{_counts(fl['errors'])}; /healthz (the pulse's last probe) "
        f"{hz['per_server_cpu_s']:,.0f}/server CPU-s, p99 {hz['p99_ms']:.1f} ms, errors "
        f"{_counts(hz['errors'])}"
    )
    print(
        f"limits: one-row indexed UPDATE via asyncpg, 10 connections, closed loop: "
        f"{pg['per_s']:,.0f} statements/s "
        f"(Postgres backends {pg['postgres_cpu_s'] / pg['seconds']:.2f} s/s, "
        f"asyncpg client {pg['generator_cpu_s'] / pg['seconds']:.2f} s/s)"
    )
    if r.get("client_errors"):
        print("connection errors the volunteers saw, by message:")
        for line, count in r["client_errors"].items():
            print(f"  {count:>6d} x {line}")
    if r.get("server_errors"):
        print("server log, exception lines (what the 5xx were):")
        for line, count in r["server_errors"].items():
            print(f"  {count:>6d} x {line}")
    if r.get("profile"):
        print("CPU of the server's event-loop thread by request part (instrumented):")
        for line in r["profile"]["lines"]:
            print("  " + line)


def _errors(r: dict[str, Any]) -> int:
    return (
        sum(
            s["n_errors"]
            for phase in r["phases"].values()
            for kind, s in phase.items()
            if isinstance(s, dict) and kind != "volunteer requests" and kind != "poll"
        )
        + r["setup"]["join"]["n_errors"]
        + r["setup"]["register"]["n_errors"]
    )


def print_goals(results: list[dict[str, Any]], goal: dict[str, float]) -> None:
    if not results:
        return
    at = [r for r in results if r["volunteers"] >= goal["volunteers"]]
    r = at[0] if at else max(results, key=lambda x: x["volunteers"])
    note = "" if at else f" (NOT measured at N = {goal['volunteers']:.0f}; largest N here)"
    n, p99 = r["volunteers"], goal["p99_ms"]
    hb = r["phases"]["idle"]["heartbeat"]
    hz = r["phases"]["idle"]["healthz"]

    def say(ok: bool) -> str:
        return "met" if ok else "NOT MET"

    print(
        f"\nGoals: {goal['volunteers']:.0f} volunteers heartbeating as the server advises, "
        f"on one server process; judged at N = {n}{note}"
    )
    print(
        f"- idle heartbeat p99 <= {p99:g} ms: {hb['p99_ms']:.1f} ms -> {say(hb['p99_ms'] <= p99)}"
    )
    hz_goal = goal["healthz_p99_ms"]
    print(
        f"- /healthz p99 <= {hz_goal:g} ms (during the idle phase): {hz['p99_ms']:.1f} ms "
        f"({hz['count']} probes) -> {say(hz['count'] > 0 and hz['p99_ms'] <= hz_goal)}"
    )
    errors = _errors(r)
    print(
        f"- zero errors (every request of every phase, 409s of the protocol apart): {errors} "
        f"-> {say(errors == 0)}"
    )
    ok = r["served_per_s"] >= 0.99 * r["offered_per_s"]
    print(
        f"- every offered heartbeat served (>= 99%): {r['served_per_s']:,.1f}/s of "
        f"{r['offered_per_s']:,.1f}/s -> {say(ok)}"
    )
    during = r["phases"]["close"]["volunteer requests"]
    upload = r["phases"]["upload"]["volunteer requests"]
    worst = max(during["p99_ms"], upload["p99_ms"])
    print(
        f"- no request waits on a close: heartbeats and joins sent while uploads were "
        f"ingested p99 {upload['p99_ms']:.1f} ms, during the close p99 {during['p99_ms']:.1f} "
        f"ms, vs idle p99 {hb['p99_ms']:.1f} ms (bound {p99:g} ms) -> {say(worst <= p99)}"
    )
    for other in results:
        if other is not r:
            o = other["phases"]["idle"]["heartbeat"]
            print(
                f"  (N = {other['volunteers']}: idle p99 {o['p99_ms']:.1f} ms, errors "
                f"{_errors(other)}, close p99 "
                f"{other['phases']['close']['volunteer requests']['p99_ms']:.1f} ms)"
            )
