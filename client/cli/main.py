"""The ``diloco`` command line. Thin commands over the library; every option also reads
an environment variable ``DILOCO_<NAME>``.

Exit codes: 0 success; 1 unexpected failure; 2 bad usage or an invalid config
(the message names the key); 3 a data file that cannot be used; 4 the server refused the
request (4xx: bad token, no such run, ...); 5 the server could not be reached, or kept
failing (connection errors, timeouts, 5xx) after retries; ``diloco verify``: 6 the
contribution failed verification, 7 it cannot be replayed. ``diloco join`` and
``diloco serve`` stopped by a signal exit 128 + its number (130 for Ctrl+C, 143 for
SIGTERM), once they have cleaned up.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from client.cli import account as account_cli
from client.cli import export as export_cli
from client.cli import sample as sample_cli
from client.cli import serve as serve_cli
from client.cli import simulate as simulate_cli
from client.cli import track as track_cli
from client.cli import verify as verify_cli
from client.cli import volunteer as volunteer_cli
from client.cli.account import (
    Device,
    GpuMemoryOpt,
    MicroBatchOpt,
    PrecisionChoice,
    PrecisionOpt,
)
from client.cli.data import data_app
from client.cli.run import run_app
from client.cli.support import ExitStatus, exit_status_for, fail

app = typer.Typer(
    help="DiLoCo Hub: train language models with DiLoCo on volunteer compute.",
    no_args_is_help=True,
    add_completion=False,
)
run_app.command("export")(export_cli.export)
run_app.command("track")(track_cli.track)
app.add_typer(run_app, name="run")
app.add_typer(data_app, name="data")
app.command()(account_cli.register)
app.command("rotate-token")(account_cli.rotate_token)
app.command()(volunteer_cli.doctor)
app.command()(volunteer_cli.me)
app.command()(simulate_cli.simulate)
app.command("plot")(simulate_cli.plot_cmd)
app.command()(sample_cli.sample)
app.command()(verify_cli.verify)
app.command(hidden=not serve_cli.installed())(serve_cli.serve)


def _package_version() -> str:
    from importlib.metadata import version as pkg_version

    return pkg_version("diloco-hub")


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(_package_version())
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    pass


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
            help="Run id to join (default: client.toml's, else the newest active run, "
            "waiting for one while there is none).",
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
    invite: Annotated[
        str | None,
        typer.Option(
            help="A private run's invite code, from its owner (once is enough).",
            envvar="DILOCO_INVITE",
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
    precision: PrecisionOpt = PrecisionChoice.auto,
    micro_batch: MicroBatchOpt = None,
    gpu_memory: GpuMemoryOpt = None,
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

    from client.worker import WorkerOptions, run_worker

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
        invite=invite,
        device=device.value if device else defaults.device or Device.auto.value,
        precision=precision.value,
        micro_batch=micro_batch,
        gpu_memory_gib=gpu_memory,
        max_rounds=max_rounds,
        max_hours=max_hours,
        threads=threads,
        quiet=quiet,
        faults=faults,
    )
    try:
        summary = asyncio.run(run_worker(opts))
    except Exception as err:
        status = exit_status_for(err)
        if status is None:
            raise
        fail(str(err), status)
    if summary.signal is not None:
        raise typer.Exit(128 + summary.signal)


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
    typer.echo(_package_version())


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
