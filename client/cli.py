"""The ``diloco`` command line. Thin commands over the library; every option also reads
an environment variable ``DILOCO_<NAME>``.

Exit codes: 0 success; 1 unexpected failure; 2 bad usage or an invalid config
(the message names the key); 3 a data file that cannot be used.
"""

from __future__ import annotations

import json
import sys
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, cast

import typer

from diloco.config import ConfigError, RunConfig, load_config, parse_config
from diloco.data import DataError

app = typer.Typer(
    help="DiLoCo Hub: train language models with DiLoCo on volunteer compute.",
    no_args_is_help=True,
    add_completion=False,
)


class SimMode(StrEnum):
    diloco = "diloco"  # K workers, H inner steps per round, outer Nesterov step
    ddp = "ddp"  # one model, K x the batch per step
    single = "single"  # one worker, 1 x the batch


class ExitStatus(IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    DATA = 3


def fail(message: str, status: ExitStatus) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(int(status))


def with_overrides(cfg: RunConfig, overrides: dict[str, dict[str, Any]]) -> RunConfig:
    """Apply CLI overrides section by section and validate the result again."""
    raw = cfg.model_dump()
    for section, values in overrides.items():
        raw[section].update({k: v for k, v in values.items() if v is not None})
    return parse_config(raw)


@app.command()
def simulate(
    config: Annotated[Path, typer.Argument(help="Run config (TOML).", envvar="DILOCO_CONFIG")],
    workers: Annotated[int, typer.Option(help="K workers.", envvar="DILOCO_WORKERS")] = 4,
    mode: Annotated[SimMode, typer.Option(help="What to train.", envvar="DILOCO_MODE")] = (
        SimMode.diloco
    ),
    out: Annotated[
        Path | None, typer.Option(help="Write the result JSON here.", envvar="DILOCO_OUT")
    ] = None,
    seed: Annotated[
        int, typer.Option(help="Seeds model, data and drops.", envvar="DILOCO_SEED")
    ] = 0,
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
    """Run DiLoCo (or a ddp / single baseline) in one process and report eval loss and bytes."""
    import torch

    from diloco.simulate import Mode, RoundRecord, SimOptions, save_result
    from diloco.simulate import simulate as run_simulation

    if not 0.0 <= drop_prob < 1.0:
        fail(f"--drop-prob must be in [0, 1), not {drop_prob}", ExitStatus.USAGE)
    if single_data not in ("shard", "all"):
        fail(f"--single-data must be shard or all, not {single_data!r}", ExitStatus.USAGE)
    if workers < 1:
        fail(f"--workers must be at least 1, not {workers}", ExitStatus.USAGE)
    if threads:
        torch.set_num_threads(threads)
    try:
        cfg = with_overrides(
            load_config(config),
            {
                "inner": {"steps": inner_steps},
                "rounds": {"max_rounds": rounds},
                "outer": {"lr": outer_lr, "momentum": outer_momentum, "nesterov": nesterov},
                "compression": {"kind": compression},
            },
        )
    except ConfigError as err:
        fail(str(err), ExitStatus.USAGE)
    opts = SimOptions(
        workers=workers,
        mode=cast(Mode, mode.value),
        seed=seed,
        drop_prob=drop_prob,
        eval_windows=eval_windows or None,
        single_data=cast(Literal["shard", "all"], single_data),
    )

    def report(r: RoundRecord) -> None:
        if not quiet:
            typer.echo(
                f"round {r.round:4d}  tokens {r.tokens:>10,}  train {r.train_loss:.4f}  "
                f"eval {r.eval_loss:.4f}  accepted {r.accepted}",
                err=True,
            )

    try:
        result = run_simulation(cfg, opts, progress=report)
    except (DataError, FileNotFoundError) as err:
        fail(str(err), ExitStatus.DATA)
    summary = {
        "mode": result.mode,
        "final_eval_loss": round(result.final_eval_loss, 5),
        "bytes_up_per_worker": result.bytes_up_per_worker,
        "bytes_down_per_worker": result.bytes_down_per_worker,
        "wall_s": round(result.wall_s, 1),
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
