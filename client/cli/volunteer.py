"""``diloco doctor`` and ``diloco me``: is this machine ready, and what has my work earned?

Both take the server from the argument or ``client.toml`` (see ``client.cli.account``).
Exit codes are those of ``client.cli.support.ExitStatus``; ``doctor`` exits 1 when a check
fails (warnings alone exit 0).
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from client.api import ServerAPI
from client.cli.account import (
    Device,
    GpuMemoryOpt,
    MicroBatchOpt,
    PrecisionChoice,
    PrecisionOpt,
    ServerArg,
    client_config,
    registered,
    server_url,
)
from client.cli.support import ExitStatus, run_api
from client.doctor import PROBE_BYTES, Check, as_json, run_doctor

STYLE = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.", envvar="DILOCO_JSON")]


def doctor(
    server: ServerArg = None,
    run: Annotated[
        str | None,
        typer.Option(
            help="Size the dry run by this run (default: newest active).", envvar="DILOCO_RUN"
        ),
    ] = None,
    device: Annotated[
        Device | None, typer.Option(help="Device to check (default: auto).", envvar="DILOCO_DEVICE")
    ] = None,
    probe_mb: Annotated[
        float,
        typer.Option(min=0.1, max=64, help="MB per speed test.", envvar="DILOCO_PROBE_MB"),
    ] = PROBE_BYTES / 1e6,
    precision: PrecisionOpt = PrecisionChoice.auto,
    micro_batch: MicroBatchOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    as_json_: JsonOpt = False,
) -> None:
    """Check this machine against a server's run, with advice for each problem.

    Device and precision, server, the micro-batch that fits and real inner steps at the
    run's model size (tokens/s, MFU, peak memory), download and upload speed."""
    cfg = client_config()
    url = server_url(server, cfg)
    device_name = device.value if device else (cfg.device or "auto")
    checks = asyncio.run(
        run_doctor(
            url,
            run_id=run or cfg.run,
            device=device_name,
            probe_bytes=int(probe_mb * 1e6),
            precision=precision.value,
            micro_batch=micro_batch,
            gpu_memory_gib=gpu_memory,
        )
    )
    if as_json_:
        typer.echo(json.dumps(as_json(checks), indent=2))
    else:
        _print_checks(checks)
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(int(ExitStatus.ERROR))


def _print_checks(checks: list[Check]) -> None:
    console = Console(highlight=False, soft_wrap=True)
    for c in checks:
        style = STYLE[c.status]
        console.print(
            f"[{style}]{c.status.upper():>4}[/{style}]  [bold]{c.name}[/bold]: {c.result}"
        )
        if c.advice:
            console.print(f"      → {c.advice}")
    failed = sum(c.status == "fail" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    verdict = "ready to join" if not failed else f"{failed} problem(s) to fix before joining"
    console.print(f"\n{verdict}" + (f"; {warned} warning(s)" if warned else ""))


def me(server: ServerArg = None, as_json_: JsonOpt = False) -> None:
    """My contributor profile on a server: contributions, tokens, credit, per run."""
    url = server_url(server, client_config())
    stored = registered(
        url, f"not registered on {url}; run `diloco register {url}` or `diloco join {url}`"
    )

    async def call(api: ServerAPI) -> dict[str, Any]:
        return await api.me()

    profile = run_api(url, stored.token, call)
    if as_json_:
        typer.echo(json.dumps(profile, indent=2))
        return
    Console(highlight=False, soft_wrap=True).print(*render_profile(profile), sep="\n")


def _when(value: object) -> str:
    if not isinstance(value, str):
        return "never"
    return datetime.fromisoformat(value).strftime("%Y-%m-%d %H:%M UTC")


def flops(value: float) -> str:
    """``6.1e15`` → ``6.10 PFLOP``: credit is training FLOPs."""
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:,.0f} FLOP"


def _in_step(c: dict[str, Any]) -> str:
    """Whether a contribution went into its round's step: yes, not yet, or left out and why
    (a failed check: the code, the sentence cut short)."""
    if c.get("aggregated"):
        return "yes"
    if excluded := c.get("excluded"):
        return escape(f"left out: {str(excluded)[:80]}")
    return "not yet"


def _pending(totals: dict[str, Any]) -> str:
    """`` + 1.2 GFLOP pending an audit`` where credit waits for one (server.rounds.escrow)."""
    pending = float(totals.get("pending_credit") or 0)
    return f" + {flops(pending)} pending an audit" if pending else ""


def render_profile(p: dict[str, Any]) -> list[Any]:
    """The profile as printable lines and tables (pure: tested without a terminal)."""
    totals, hw = p.get("totals") or {}, p.get("hardware") or {}
    name = escape(str(p.get("name")))
    out: list[Any] = [
        f"[bold]{name}[/bold] ({p.get('id')}), since {_when(p.get('created_at'))}, "
        f"last seen {_when(p.get('last_seen_at'))}",
        escape(f"hardware: {hw.get('device', '?')} {hw.get('device_name', '')}".rstrip())
        if hw
        else "hardware: not reported yet (it is sent when diloco join starts)",
        f"contributions: {totals.get('accepted', 0)} accepted, "
        f"{totals.get('aggregated', 0)} in an outer step; "
        f"{totals.get('tokens', 0):,} tokens; credit {flops(float(totals.get('credit', 0)))}"
        + _pending(totals),
    ]
    earned = p.get("standing")
    if isinstance(earned, int | float) and earned < 1.0:  # diloco.protocol.reputation
        out.append(
            f"standing {earned:.0%}: your uploads count for that share of their tokens, in the "
            "step and in credit, until verified work earns the rest"
        )
    if p.get("quarantined_at"):  # diloco.protocol.reputation
        why = p.get("quarantine_reason")
        out.append(escape(f"QUARANTINED since {_when(p['quarantined_at'])}: {why}"))
    runs = p.get("runs") or []
    if runs:
        table = Table("run", "accepted", "in a step", "tokens", "credit", "last round")
        for r in runs:
            table.add_row(
                f"{r.get('run_name')} ({r.get('run_id')})",
                str(r.get("accepted")),
                str(r.get("aggregated")),
                f"{r.get('tokens', 0):,}",
                flops(float(r.get("credit", 0))) + _pending(r),
                str(r.get("last_round")),
            )
        out.append(table)
    recent = p.get("recent") or []
    if recent:
        table = Table("run", "round", "tokens", "loss", "uploaded", "in a step", "credit")
        for c in recent:
            table.add_row(
                str(c.get("run_id")),
                str(c.get("round")),
                f"{c.get('tokens', 0):,}",
                f"{c.get('loss', float('nan')):.4f}",
                _when(c.get("created_at")),
                _in_step(c),
                flops(float(c.get("credit", 0)))
                + (
                    f" ({status})"
                    if (status := c.get("credit_status", "confirmed")) != "confirmed"
                    else ""
                ),
            )
        out.append(table)
    return out
