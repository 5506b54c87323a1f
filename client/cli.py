"""The ``diloco`` command line. Thin commands over the library; every option also reads
an environment variable ``DILOCO_<NAME>``.

Exit codes: 0 success; 1 unexpected failure; 2 bad usage or an invalid config
(the message names the key); 3 a data file that cannot be used; 4 the server refused the
request (4xx: bad token, no such run, ...); 5 the server could not be reached, or kept
failing (connection errors, timeouts, 5xx) after retries. ``diloco join`` and
``diloco serve`` stopped by a signal exit 128 + its number (130 for Ctrl+C, 143 for
SIGTERM), once they have cleaned up.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import typer

from client import account_cli, volunteer_cli
from client.cli_support import ExitStatus, exit_status_for, fail
from client.run_cli import run_app
from diloco.config import ConfigError, RunConfig, load_config, parse_config
from diloco.data import DataError

if TYPE_CHECKING:  # imported where used: they load torch
    from diloco.simulate_protocol import Outage, ProtocolRound

app = typer.Typer(
    help="DiLoCo Hub: train language models with DiLoCo on volunteer compute.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(run_app, name="run")
app.command()(account_cli.register)
app.command()(volunteer_cli.doctor)
app.command()(volunteer_cli.me)


class SimMode(StrEnum):
    diloco = "diloco"  # K workers, H inner steps per round, outer Nesterov step
    ddp = "ddp"  # one model, K x the batch per step
    single = "single"  # one worker, 1 x the batch
    protocol = "protocol"  # K volunteers against the round protocol, on a simulated clock


class Device(StrEnum):
    auto = "auto"  # cuda if available, else mps, else cpu
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


def with_overrides(cfg: RunConfig, overrides: dict[str, dict[str, Any]]) -> RunConfig:
    """Apply CLI overrides section by section and validate the result again."""
    raw = cfg.model_dump()
    for section, values in overrides.items():
        raw[section].update({k: v for k, v in values.items() if v is not None})
    return parse_config(raw)


def _numbers(option: str, text: str | None) -> tuple[float, ...] | None:
    """``--speeds 1,1,0.5``: comma-separated numbers, or a usage error naming the option."""
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        fail(f"{option} takes comma-separated numbers, not {text!r}", ExitStatus.USAGE)


def _outage(text: str) -> Outage:
    """``--outage 2@30:90``: volunteer 2 offline from 30 s to 90 s (``2@30``: for good)."""
    from diloco.simulate_protocol import Outage

    try:
        who, _, when = text.partition("@")
        at, _, back = when.partition(":")
        return Outage(int(who), float(at), float(back) if back else None)
    except ValueError:
        fail(f"--outage takes VOLUNTEER@START[:END] in seconds, not {text!r}", ExitStatus.USAGE)


def _protocol_line(r: ProtocolRound) -> str:
    extended = f", extended {r.extensions}x" if r.extensions else ""
    return (
        f"  {r.opened_at_s:.0f}-{r.closed_at_s:.0f} s  leases {r.leases}{extended}  "
        f"{r.close_code}: {r.close_reason}"
    )


@app.command()
def simulate(
    config: Annotated[Path, typer.Argument(help="Run config (TOML).", envvar="DILOCO_CONFIG")],
    workers: Annotated[
        int | None,
        typer.Option(
            help="K workers (protocol: volunteers) (default: as many as --speeds, else 4).",
            envvar="DILOCO_WORKERS",
            show_default=False,
        ),
    ] = None,
    mode: Annotated[SimMode, typer.Option(help="What to train.", envvar="DILOCO_MODE")] = (
        SimMode.diloco
    ),
    out: Annotated[
        Path | None, typer.Option(help="Write the result JSON here.", envvar="DILOCO_OUT")
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            help="Seeds model, data and drops (default: the config's seed, else 0).",
            envvar="DILOCO_SEED",
            show_default=False,
        ),
    ] = None,
    compression: Annotated[
        str | None, typer.Option(help="none | int8 (default: config).", envvar="DILOCO_COMPRESSION")
    ] = None,
    inner_steps: Annotated[
        int | None,
        typer.Option(
            "--inner-steps", "-H", help="H (default: config).", envvar="DILOCO_INNER_STEPS"
        ),
    ] = None,
    rounds: Annotated[
        int | None,
        typer.Option(help="Rounds (default: config max_rounds).", envvar="DILOCO_ROUNDS"),
    ] = None,
    quorum: Annotated[
        int | None, typer.Option(help="rounds.quorum (default: config).", envvar="DILOCO_QUORUM")
    ] = None,
    target: Annotated[
        int | None, typer.Option(help="rounds.target (default: config).", envvar="DILOCO_TARGET")
    ] = None,
    timeout_s: Annotated[
        float | None,
        typer.Option(help="rounds.timeout_s (default: config).", envvar="DILOCO_TIMEOUT_S"),
    ] = None,
    outer_lr: Annotated[float | None, typer.Option(envvar="DILOCO_OUTER_LR")] = None,
    outer_momentum: Annotated[float | None, typer.Option(envvar="DILOCO_OUTER_MOMENTUM")] = None,
    nesterov: Annotated[
        bool | None, typer.Option("--nesterov/--no-nesterov", envvar="DILOCO_NESTEROV")
    ] = None,
    drop_prob: Annotated[
        float,
        typer.Option(
            help="Lose each contribution with this probability.", envvar="DILOCO_DROP_PROB"
        ),
    ] = 0.0,
    batches: Annotated[
        str,
        typer.Option(
            help="diloco mode: worker i's own batch stream on shard i, or the i-th lease's "
            "shard and seed each round (as protocol mode and the platform).",
            envvar="DILOCO_BATCHES",
        ),
    ] = "worker",
    speeds: Annotated[
        str | None,
        typer.Option(
            help="protocol: relative speed of each volunteer, e.g. 1,1,0.5,0.25 (default: all 1).",
            envvar="DILOCO_SPEEDS",
            show_default=False,
        ),
    ] = None,
    step_s: Annotated[
        float,
        typer.Option(
            help="protocol: simulated seconds of one inner step at speed 1.",
            envvar="DILOCO_STEP_S",
        ),
    ] = 1.0,
    join_at: Annotated[
        str | None,
        typer.Option(
            help="protocol: each volunteer's first join, in seconds, e.g. 0,0,60 (default: 0).",
            envvar="DILOCO_JOIN_AT",
            show_default=False,
        ),
    ] = None,
    drop_per_min: Annotated[
        float,
        typer.Option(
            help="protocol: chance an online volunteer drops out within a simulated minute.",
            envvar="DILOCO_DROP_PER_MIN",
        ),
    ] = 0.0,
    return_per_min: Annotated[
        float,
        typer.Option(
            help="protocol: chance an offline volunteer comes back within a simulated minute.",
            envvar="DILOCO_RETURN_PER_MIN",
        ),
    ] = 0.0,
    outage: Annotated[
        list[str] | None,
        typer.Option(
            help="protocol: volunteer V offline from START s (to END s), as V@START[:END]; "
            "repeatable.",
            envvar="DILOCO_OUTAGE",
            show_default=False,
        ),
    ] = None,
    lease_ttl_s: Annotated[
        float, typer.Option(help="protocol: the hub's lease TTL.", envvar="DILOCO_LEASE_TTL_S")
    ] = 30.0,
    heartbeat_interval_s: Annotated[
        float,
        typer.Option(
            help="protocol: volunteers' heartbeat interval.", envvar="DILOCO_HEARTBEAT_INTERVAL_S"
        ),
    ] = 10.0,
    sweep_interval_s: Annotated[
        float,
        typer.Option(
            help="protocol: how often the sweeper ticks.", envvar="DILOCO_SWEEP_INTERVAL_S"
        ),
    ] = 1.0,
    max_extensions: Annotated[
        int | None,
        typer.Option(
            help="protocol: deadline extensions below quorum (default: no limit).",
            envvar="DILOCO_MAX_EXTENSIONS",
            show_default=False,
        ),
    ] = None,
    close_s: Annotated[
        float,
        typer.Option(help="protocol: simulated seconds a close takes.", envvar="DILOCO_CLOSE_S"),
    ] = 0.0,
    max_sim_s: Annotated[
        float | None,
        typer.Option(
            help="protocol: stop the simulated clock here (default: when the run ends).",
            envvar="DILOCO_MAX_SIM_S",
            show_default=False,
        ),
    ] = None,
    eval_windows: Annotated[
        int,
        typer.Option(
            help="Validation windows scored per round (0: all).", envvar="DILOCO_EVAL_WINDOWS"
        ),
    ] = 256,
    single_data: Annotated[
        str,
        typer.Option(
            help="single mode trains on worker 0's shard, or on all the training data.",
            envvar="DILOCO_SINGLE_DATA",
        ),
    ] = "shard",
    plot: Annotated[
        Path | None,
        typer.Option(help="Draw eval loss vs tokens to this PNG.", envvar="DILOCO_PLOT"),
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="torch CPU threads.", envvar="DILOCO_THREADS")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No per-round lines.", envvar="DILOCO_QUIET")] = False,
) -> None:
    """Run DiLoCo (or a ddp / single baseline, or volunteers against the round protocol on a
    simulated clock) in one process and report eval loss and bytes."""
    import torch

    from diloco.simulate import Mode, RoundRecord, SimOptions, save_result
    from diloco.simulate import simulate as run_simulation
    from diloco.simulate_hub import HubSettings
    from diloco.simulate_protocol import ProtocolOptions, ProtocolRound

    if not 0.0 <= drop_prob < 1.0:
        fail(f"--drop-prob must be in [0, 1), not {drop_prob}", ExitStatus.USAGE)
    if single_data not in ("shard", "all"):
        fail(f"--single-data must be shard or all, not {single_data!r}", ExitStatus.USAGE)
    if batches not in ("worker", "lease"):
        fail(f"--batches must be worker or lease, not {batches!r}", ExitStatus.USAGE)
    speed_list = _numbers("--speeds", speeds)
    join_list = _numbers("--join-at", join_at)
    K = workers if workers is not None else len(speed_list) if speed_list else 4
    if K < 1:
        fail(f"--workers must be at least 1, not {K}", ExitStatus.USAGE)
    if threads:
        torch.set_num_threads(threads)
    try:
        cfg = with_overrides(
            load_config(config),
            {
                "inner": {"steps": inner_steps},
                "rounds": {
                    "max_rounds": rounds,
                    "quorum": quorum,
                    "target": target,
                    "timeout_s": timeout_s,
                },
                "outer": {"lr": outer_lr, "momentum": outer_momentum, "nesterov": nesterov},
                "compression": {"kind": compression},
            },
        )
    except ConfigError as err:
        fail(str(err), ExitStatus.USAGE)
    protocol = None
    try:
        if mode is SimMode.protocol:
            protocol = ProtocolOptions(
                speeds=speed_list,
                step_s=step_s,
                join_at_s=join_list,
                drop_per_min=drop_per_min,
                return_per_min=return_per_min,
                outages=tuple(_outage(o) for o in outage or ()),
                hub=HubSettings(
                    sweep_interval_s=sweep_interval_s,
                    heartbeat_interval_s=heartbeat_interval_s,
                    lease_ttl_s=lease_ttl_s,
                    max_extensions=max_extensions,
                    close_s=close_s,
                ),
                max_sim_s=max_sim_s,
            ).checked(K)
            if drop_prob:
                raise ValueError("--drop-prob: protocol mode drops volunteers (--drop-per-min)")
        elif speed_list or join_list or outage or drop_per_min or return_per_min:
            raise ValueError(
                "--speeds, --join-at, --outage, --drop-per-min and --return-per-min "
                "apply to --mode protocol only"
            )
        if batches != "worker" and mode is not SimMode.diloco:
            raise ValueError(f"--batches {batches} applies to --mode diloco only")
    except ValueError as err:
        fail(str(err), ExitStatus.USAGE)
    opts = SimOptions(
        workers=K,
        mode=cast(Mode, mode.value),
        seed=seed if seed is not None else cfg.seed or 0,
        drop_prob=drop_prob,
        eval_windows=eval_windows or None,
        single_data=cast(Literal["shard", "all"], single_data),
        batches=cast(Literal["worker", "lease"], batches),
    )

    def report(r: RoundRecord) -> None:
        if not quiet:
            typer.echo(
                f"round {r.round:4d}  tokens {r.tokens:>10,}  train {r.train_loss:.4f}  "
                f"eval {r.eval_loss:.4f}  accepted {r.accepted}"
                + (_protocol_line(r) if isinstance(r, ProtocolRound) else ""),
                err=True,
            )

    try:
        result = run_simulation(cfg, opts, progress=report, protocol=protocol)
    except (DataError, FileNotFoundError) as err:
        fail(str(err), ExitStatus.DATA)
    summary: dict[str, Any] = {
        "mode": result.mode,
        "final_eval_loss": round(result.final_eval_loss, 5),
        "bytes_up_per_worker": result.bytes_up_per_worker,
        "bytes_down_per_worker": result.bytes_down_per_worker,
        "wall_s": round(result.wall_s, 1),
    }
    if (totals := result.protocol) is not None:
        summary |= {
            "rounds": len(result.rounds),
            "stopped_because": totals.stopped_because,
            "sim_time_s": totals.sim_time_s,
            "goodput": round(totals.goodput, 4),
            "refused": totals.refused,
            "abandoned": totals.abandoned,
            "extensions": totals.extensions,
        }
    typer.echo(json.dumps(summary))
    if out:
        save_result(result, out)
    if plot:
        from diloco.plot import plot_results

        plot_results([result.to_json()], plot)


@app.command("plot")
def plot_cmd(
    results: Annotated[list[Path], typer.Argument(help="Result JSON files from simulate.")],
    out: Annotated[Path, typer.Option(help="PNG to write.", envvar="DILOCO_PLOT_OUT")],
) -> None:
    """Draw eval loss vs tokens for one or more simulate results."""
    from diloco.plot import load_results, plot_results

    try:
        plot_results(load_results(results), out)
    except (OSError, json.JSONDecodeError, KeyError) as err:
        fail(f"cannot plot: {err}", ExitStatus.DATA)


@app.command()
def join(
    server: Annotated[
        str | None,
        typer.Argument(
            help="Server URL, e.g. http://localhost:8000 (default: the one in client.toml, "
            "written by the installer or `diloco register`).",
            envvar="DILOCO_SERVER",
            metavar="SERVER_URL",
            show_default=False,
        ),
    ] = None,
    run: Annotated[
        str | None,
        typer.Option(
            help="Run id to join (default: client.toml's, else the newest active run).",
            envvar="DILOCO_RUN",
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            help="Register under this name on first use (default: client.toml's, else "
            "volunteer@HOSTNAME).",
            envvar="DILOCO_NAME",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="Contributor token to use instead of the stored one.", envvar="DILOCO_TOKEN"
        ),
    ] = None,
    device: Annotated[
        Device | None,
        typer.Option(
            help="Where to train (auto: cuda, mps, cpu) [default: client.toml's, else auto].",
            envvar="DILOCO_DEVICE",
            show_default=False,
        ),
    ] = None,
    max_rounds: Annotated[
        int | None,
        typer.Option(
            min=1, help="Stop after this many accepted contributions.", envvar="DILOCO_MAX_ROUNDS"
        ),
    ] = None,
    max_hours: Annotated[
        float | None,
        typer.Option(
            help="Stop after this many hours (a round in progress is dropped, its lease given "
            "back).",
            envvar="DILOCO_MAX_HOURS",
        ),
    ] = None,
    threads: Annotated[
        int | None, typer.Option(min=1, help="torch CPU threads.", envvar="DILOCO_THREADS")
    ] = None,
    quiet: Annotated[
        bool,
        typer.Option(help="No progress bar and no per-round lines.", envvar="DILOCO_QUIET"),
    ] = False,
    faults: Annotated[
        str, typer.Option(hidden=True, envvar="DILOCO_FAULTS", help="Tests only (diloco.faults).")
    ] = "",
) -> None:
    """Volunteer: train on a run's rounds and upload the results until stopped (Ctrl+C)."""
    import asyncio

    from client.worker import NoActiveRun, WorkerOptions, run_worker

    if name and token:
        fail("pass --name (to register) or --token (to reuse a token), not both", ExitStatus.USAGE)
    if max_hours is not None and not max_hours > 0:
        fail(f"--max-hours must be more than 0, got {max_hours}", ExitStatus.USAGE)
    defaults = account_cli.client_config()  # flags and DILOCO_* variables win over client.toml
    opts = WorkerOptions(
        server_url=account_cli.server_url(server, defaults),
        run_id=run or defaults.run,
        name=name or (None if token else defaults.name),
        token=token,
        device=device.value if device else defaults.device or Device.auto.value,
        max_rounds=max_rounds,
        max_hours=max_hours,
        threads=threads,
        quiet=quiet,
        faults=faults,
    )
    try:
        summary = asyncio.run(run_worker(opts))
    except NoActiveRun as err:
        fail(str(err), ExitStatus.ERROR)
    except Exception as err:
        status = exit_status_for(err)
        if status is None:
            raise
        fail(str(err), status)
    if summary.signal is not None:
        raise typer.Exit(128 + summary.signal)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.", envvar="DILOCO_HOST")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="Port to listen on.", envvar="DILOCO_PORT")] = 8000,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Checkpoints, uploads, embedded database (default: $XDG_DATA_HOME/diloco).",
            envvar="DILOCO_DATA_DIR",
        ),
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option(
            help="Postgres URL (default: an embedded Postgres under the data dir).",
            envvar="DILOCO_DATABASE_URL",
            show_default=False,
        ),
    ] = None,
    role: Annotated[
        str,
        typer.Option(
            help="all: API, dashboard and round work; api: the API and dashboard only; "
            "worker: decide and close rounds only (serves /healthz and /metrics). Several "
            "processes may share one database.",
            envvar="DILOCO_ROLE",
        ),
    ] = "all",
) -> None:
    """Run the server: REST API, dashboard and the background round work."""
    from client.credentials import default_data_dir

    try:
        from server.main import serve as serve_app
    except ModuleNotFoundError as err:
        fail(
            f"diloco serve needs the server extra ({err.name} is missing): "
            "pip install 'diloco-hub[server]'",
            ExitStatus.USAGE,
        )
    if role not in ("all", "api", "worker"):
        fail(f"--role must be all, api or worker, not {role!r}", ExitStatus.USAGE)
    status = serve_app(
        host=host,
        port=port,
        data_dir=data_dir or default_data_dir(),
        database_url=database_url,
        role=role,
    )
    if status:
        raise typer.Exit(status)  # 128 + the signal that stopped it


@app.command()
def demo(
    config: Annotated[
        Path, typer.Option(help="Run config (TOML).", envvar="DILOCO_DEMO_CONFIG")
    ] = Path("examples/demo.toml"),
    data_dir: Annotated[
        Path, typer.Option(help="Server data, volunteers and logs.", envvar="DILOCO_DEMO_DIR")
    ] = Path("out/demo"),
    port: Annotated[int, typer.Option(help="Server port.", envvar="DILOCO_PORT")] = 8000,
    volunteers: Annotated[
        int, typer.Option(min=1, help="Local volunteers.", envvar="DILOCO_VOLUNTEERS")
    ] = 2,
    threads: Annotated[
        int, typer.Option(min=1, help="torch threads per volunteer.", envvar="DILOCO_THREADS")
    ] = 1,
    timeout: Annotated[
        float, typer.Option(help="Give up after this many seconds.", envvar="DILOCO_TIMEOUT")
    ] = 1800.0,
) -> None:
    """The whole platform on this machine: server with embedded Postgres, a run, volunteers."""
    from client.demo import DemoError, run_demo

    try:
        status = run_demo(
            config=config,
            data_dir=data_dir,
            port=port,
            volunteers=volunteers,
            threads=threads,
            timeout_s=timeout,
        )
    except DemoError as err:
        fail(str(err), ExitStatus.ERROR)
    raise typer.Exit(status)


@app.command()
def version() -> None:
    """Print the version."""
    from importlib.metadata import version as pkg_version

    typer.echo(pkg_version("diloco-hub"))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
