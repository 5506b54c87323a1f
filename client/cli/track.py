"""``diloco run track``: follow a run into TensorBoard and/or W&B (``client.tracking``).

The trackers are the ``track`` extra (``pip install 'diloco-hub[track]'``), which a
volunteer's install lacks: the command checks for them before it does anything and says
how to install them (exit 2). Exit codes are those of ``client.cli.support.ExitStatus``;
stopped by SIGINT or SIGTERM: 128 + its number, once the points it had are written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from client.cli.run import RunId, Server
from client.cli.support import ExitStatus, exit_status_for, fail


def track(
    run_id: RunId,
    server: Server,
    tensorboard: Annotated[
        Path | None,
        typer.Option(
            "--tensorboard",
            help="Write TensorBoard event files under DIR/<run id> (`tensorboard --logdir DIR`).",
            metavar="DIR",
            envvar="DILOCO_TRACK_TENSORBOARD",
        ),
    ] = None,
    wandb_project: Annotated[
        str | None,
        typer.Option(
            "--wandb",
            help="Log to this W&B project, as a W&B run with the run's id (WANDB_MODE=offline: "
            "to disk, for `wandb sync`).",
            metavar="PROJECT",
            envvar="DILOCO_TRACK_WANDB",
        ),
    ] = None,
    wandb_entity: Annotated[
        str | None,
        typer.Option(
            "--wandb-entity", help="The W&B entity (default: W&B's own).", envvar="WANDB_ENTITY"
        ),
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="One pass: write what is new, then exit.")
    ] = False,
    poll_s: Annotated[
        float,
        typer.Option(
            "--poll-s", min=0.1, help="Seconds between two reads of the run.", metavar="S"
        ),
    ] = 10.0,
    eval_wait_s: Annotated[
        float,
        typer.Option(
            "--eval-wait-s",
            min=0.0,
            help="Once the run has ended, how long to wait for eval losses still pending.",
            metavar="S",
        ),
    ] = 600.0,
    give_up_s: Annotated[
        float,
        typer.Option(
            "--give-up-s",
            min=0.0,
            help="Exit (5) once the server has failed for this long without a break.",
            metavar="S",
        ),
    ] = 3600.0,
) -> None:
    """Follow a run into TensorBoard and/or W&B: every closed round written once (eval and
    train loss, tokens, contributions, bytes up, update norm, close reason), cumulative
    tokens as the step. Stops when the run is completed or cancelled and all is written."""
    import asyncio

    from client.tracking.follow import TrackOptions
    from client.tracking.follow import track as follow_run
    from client.tracking.points import TrackError
    from client.tracking.sinks import missing_module, missing_sentence

    if tensorboard is None and wandb_project is None:
        fail("name a tracker: --tensorboard DIR and/or --wandb PROJECT", ExitStatus.USAGE)
    for option, asked in (("--tensorboard", tensorboard), ("--wandb", wandb_project)):
        if asked is None:
            continue
        missing = missing_module(tensorboard=option == "--tensorboard", wandb=option == "--wandb")
        if missing is not None:
            fail(missing_sentence(option, missing), ExitStatus.USAGE)
    opts = TrackOptions(
        server_url=server,
        run_id=run_id,
        tensorboard=tensorboard,
        wandb_project=wandb_project,
        wandb_entity=wandb_entity,
        once=once,
        poll_s=poll_s,
        eval_wait_s=eval_wait_s,
        give_up_s=give_up_s,
    )
    try:
        summary = asyncio.run(follow_run(opts, typer.echo))
    except TrackError as err:
        fail(str(err), ExitStatus.USAGE)
    except Exception as err:
        status = exit_status_for(err)
        if status is None:
            raise
        fail(str(err), status)
    if summary.missing_evals:
        rounds = ", ".join(str(i) for i in summary.missing_evals)
        typer.echo(
            f"warning: no eval loss came for round(s) {rounds} within {eval_wait_s:.0f} s of "
            "the run's end (the eval failed, or was not finite); written without it",
            err=True,
        )
    if summary.signal is not None:
        raise typer.Exit(128 + summary.signal)
    typer.echo(f"run {run_id} is {summary.status}: {summary.rounds} closed round(s) written")
