"""Where the points go: TensorBoard event files and a W&B run, each with its state file.
Both are the ``track`` extra: ``missing_module`` finds what an install lacks without
importing it."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from client.tracking.points import STATE_FILE, Logged, RoundPoint

INSTALL_HINT = "pip install 'diloco-hub[track]'"


def missing_module(*, tensorboard: bool, wandb: bool) -> str | None:
    """The first module the asked trackers need that this install lacks (None: all there),
    found without importing anything."""
    wanted = (["torch", "tensorboard"] if tensorboard else []) + (["wandb"] if wandb else [])
    for name in wanted:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


def missing_sentence(option: str, module: str) -> str:
    return f"{option} needs the track extra, which this install lacks ({module} is missing): " + (
        INSTALL_HINT
    )


# ---------------------------------------------------------------------------- the sinks


class Sink(Protocol):
    label: str
    logged: Logged

    def write_round(self, point: RoundPoint) -> None:
        """The round's scalars and close reason, and its eval loss when known."""

    def write_eval(self, point: RoundPoint) -> None:
        """The round's eval loss alone, at its step."""

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files under ``logdir/<run id>`` (``torch.utils.tensorboard.SummaryWriter``): a
    log dir holding several runs shows them side by side. The state file sits beside them."""

    def __init__(self, logdir: Path, run: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        run_id = str(run["id"])
        self.dir = logdir / run_id
        self.label = f"TensorBoard {self.dir}"
        self.logged = Logged.load(self.dir / STATE_FILE, run_id)
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def write_round(self, point: RoundPoint) -> None:
        for tag, value in point.scalars().items():
            self.writer.add_scalar(tag, value, global_step=point.step)
        self.writer.add_text("round/close_reason", point.reason, global_step=point.step)
        if point.eval_loss is not None:
            self.write_eval(point)

    def write_eval(self, point: RoundPoint) -> None:
        assert point.eval_loss is not None
        self.writer.add_scalar("loss/eval", point.eval_loss, global_step=point.step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run with the DiLoCo run's id (resumed when it exists: a restarted tracker adds
    to it), the run's config as its config, ``tokens`` as every key's step metric. Its
    state file is ``<wandb dir>/diloco-track/<project>-<run id>.json``. ``WANDB_MODE=
    offline`` writes the run to disk for a later ``wandb sync``."""

    def __init__(
        self, project: str, run: Mapping[str, Any], *, entity: str | None, server_url: str
    ) -> None:
        import wandb

        run_id = str(run["id"])
        config = {
            "diloco": {"run_id": run_id, "server": server_url, "n_params": run.get("n_params")},
            **dict(run.get("config") or {}),
        }
        self.run = wandb.init(
            project=project,
            entity=entity,
            id=run_id,
            name=str(run.get("name") or run_id),
            config=config,
            resume="allow",
            settings=wandb.Settings(console="off", save_code=False),
        )
        self.run.define_metric("tokens")
        self.run.define_metric("*", step_metric="tokens")
        self.label = f"W&B {project}/{run_id}"
        state_dir = Path(self.run.settings.wandb_dir) / "diloco-track"
        self.logged = Logged.load(state_dir / f"{project}-{run_id}.json", run_id)

    def write_round(self, point: RoundPoint) -> None:
        row: dict[str, Any] = {"tokens": point.step, **point.scalars()}
        row["round/close_reason"] = point.reason
        if point.eval_loss is not None:
            row["loss/eval"] = point.eval_loss
        self.run.log(row)

    def write_eval(self, point: RoundPoint) -> None:
        self.run.log(
            {"tokens": point.step, "round/index": point.index, "loss/eval": point.eval_loss}
        )

    def flush(self) -> None:
        pass  # wandb hands each row to its service at once; finish() waits for it

    def close(self) -> None:
        self.run.finish()
