"""``diloco simulate`` and ``diloco plot``: the algorithm in one process, and its plots.

``--mode diloco|ddp|single`` trains K workers the way the paper's experiments do;
``--mode protocol`` runs K volunteers against the round protocol's rules on a simulated
clock (speeds, dropouts, deadlines: ``diloco.simulate.protocol_mode``). Exit codes are those of
``client.cli.support.ExitStatus``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import typer

from client.cli.simulate_args import (
    SimMode,
    check_choices,
    device_for,
    links_of,
    numbers,
    outage_of,
    protocol_options,
    refuse_misfits,
    run_config,
)
from client.cli.support import ExitStatus, fail

if TYPE_CHECKING:  # imported where used: they load torch
    from diloco.simulate.protocol_mode import ProtocolRound
    from diloco.simulate.run import RoundRecord, SimResult


def _protocol_line(r: ProtocolRound) -> str:
    extended = f", extended {r.extensions}x" if r.extensions else ""
    return (
        f"  {r.opened_at_s:.0f}-{r.closed_at_s:.0f} s  leases {r.leases}{extended}  "
        f"{r.close_code}: {r.close_reason}"
    )


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
        str | None,
        typer.Option(
            help="none | int8 | int4 | int2 | sparse (default: config).",
            envvar="DILOCO_COMPRESSION",
        ),
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
            help="worker: worker i's own batch stream on shard i; lease: as the platform "
            "deals leases (a text run's shard and seed, a dataset run's data units), as "
            "protocol mode always does.",
            envvar="DILOCO_BATCHES",
        ),
    ] = "worker",
    downloads: Annotated[
        str,
        typer.Option(
            help="diloco, protocol: workers download the fp32 checkpoint every round (full), or "
            "the deltas between versions (the run's [compression] download codec) and start "
            "from the parameters they define (delta).",
            envvar="DILOCO_DOWNLOADS",
        ),
    ] = "full",
    overlap: Annotated[
        float | None,
        typer.Option(
            help="diloco, protocol: the run's [inner] overlap: the share of H a worker trains "
            "ahead, from its own end of the round before, while the next version is published, "
            "before it folds that version in (default: the config's).",
            envvar="DILOCO_OVERLAP",
        ),
    ] = None,
    speeds: Annotated[
        str | None,
        typer.Option(
            help="protocol: relative speed of each volunteer, e.g. 1,1,0.5,0.25 (default: all 1).",
            envvar="DILOCO_SPEEDS",
            show_default=False,
        ),
    ] = None,
    size_h: Annotated[
        bool,
        typer.Option(
            help="protocol: size each lease's H to its volunteer's speed, as the server does.",
            envvar="DILOCO_SIZE_H",
        ),
    ] = False,
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
    sweep_interval_s: Annotated[
        float,
        typer.Option(
            help="protocol: how often the sweeper ticks.", envvar="DILOCO_SWEEP_INTERVAL_S"
        ),
    ] = 1.0,
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
    link: Annotated[
        str | None,
        typer.Option(
            help="protocol: every volunteer's link, UP/DOWN megabits per second and an "
            "optional /LATENCY in ms (20/100/40): uploads and downloads take their time.",
            envvar="DILOCO_LINK",
            show_default=False,
        ),
    ] = None,
    link_as_params: Annotated[
        float | None,
        typer.Option(
            help="protocol, with --link: transfers sized as for a model of this many "
            "parameters (1e9: a 1B model's bytes).",
            envvar="DILOCO_LINK_AS_PARAMS",
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
    device: Annotated[
        str,
        typer.Option(
            help="cpu, cuda, cuda:N, mps or auto: where every worker trains.",
            envvar="DILOCO_DEVICE",
        ),
    ] = "cpu",
    quiet: Annotated[bool, typer.Option(help="No per-round lines.", envvar="DILOCO_QUIET")] = False,
) -> None:
    """Run DiLoCo (or a ddp / single baseline, or volunteers against the round protocol on a
    simulated clock) in one process and report eval loss and bytes."""
    from diloco.data.text import DataError
    from diloco.simulate.run import Downloads, Mode, SimOptions
    from diloco.simulate.run import simulate as run_simulation

    check_choices(drop_prob, single_data, batches, downloads, overlap)
    speed_list = numbers("--speeds", speeds)
    K = workers if workers is not None else len(speed_list) if speed_list else 4
    if K < 1:
        fail(f"--workers must be at least 1, not {K}", ExitStatus.USAGE)
    chosen = device_for(device, threads)
    cfg = run_config(
        config,
        {
            "inner": {"steps": inner_steps, "overlap": overlap},
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
    try:
        protocol = protocol_options(
            mode,
            K,
            speeds=speed_list,
            step_s=step_s,
            join_at=numbers("--join-at", join_at),
            drop_per_min=drop_per_min,
            return_per_min=return_per_min,
            outages=tuple(outage_of(o) for o in outage or ()),
            sweep_interval_s=sweep_interval_s,
            close_s=close_s,
            max_sim_s=max_sim_s,
            size_h=size_h,
            links=links_of(link, link_as_params),
        )
        refuse_misfits(
            mode, drop_prob=drop_prob, batches=batches, downloads=downloads, overlap=overlap
        )
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
        downloads=cast(Downloads, downloads),
        device=chosen,
    )
    try:
        result = run_simulation(cfg, opts, progress=_reporter(quiet), protocol=protocol)
    except (DataError, FileNotFoundError) as err:
        fail(str(err), ExitStatus.DATA)
    typer.echo(json.dumps(_summary(result)))
    _save(result, out, plot)


def _save(result: SimResult, out: Path | None, plot: Path | None) -> None:
    from diloco.simulate.run import save_result

    if out:
        save_result(result, out)
    if plot:
        from diloco.simulate.plot import plot_results

        plot_results([result.to_json()], plot)


def _reporter(quiet: bool) -> Callable[[RoundRecord], None]:
    from diloco.simulate.protocol_mode import ProtocolRound

    def report(r: RoundRecord) -> None:
        if not quiet:
            typer.echo(
                f"round {r.round:4d}  tokens {r.tokens:>10,}  train {r.train_loss:.4f}  "
                f"eval {r.eval_loss:.4f}  accepted {r.accepted}"
                + (_protocol_line(r) if isinstance(r, ProtocolRound) else ""),
                err=True,
            )

    return report


def _summary(result: SimResult) -> dict[str, Any]:
    """The one JSON line ``diloco simulate`` prints."""
    summary: dict[str, Any] = {
        "mode": result.mode,
        "final_eval_loss": round(result.final_eval_loss, 5),
        "bytes_up_per_worker": result.bytes_up_per_worker,
        "bytes_down_per_worker": result.bytes_down_per_worker,
        "wall_s": round(result.wall_s, 1),
    }
    if (delta := result.delta) is not None and delta.final_eval_loss_outer is not None:
        summary |= {
            "downloads": result.downloads,
            "delta_bytes": delta.delta_bytes,
            "checkpoint_bytes": delta.checkpoint_bytes,
            "final_eval_loss_outer": round(delta.final_eval_loss_outer, 5),
        }
    if (totals := result.protocol) is not None:
        summary |= {
            "rounds": len(result.rounds),
            "stopped_because": totals.stopped_because,
            "sim_time_s": totals.sim_time_s,
            "transfer_s": round(totals.transfer_s, 3),
            "goodput": round(totals.goodput, 4),
            "refused": totals.refused,
            "abandoned": totals.abandoned,
            "extensions": totals.extensions,
        }
    return summary


def plot_cmd(
    results: Annotated[list[Path], typer.Argument(help="Result JSON files from simulate.")],
    out: Annotated[Path, typer.Option(help="PNG to write.", envvar="DILOCO_PLOT_OUT")],
) -> None:
    """Draw eval loss vs tokens for one or more simulate results."""
    from diloco.simulate.plot import load_results, plot_results

    try:
        plot_results(load_results(results), out)
    except (OSError, json.JSONDecodeError, KeyError) as err:
        fail(f"cannot plot: {err}", ExitStatus.DATA)
