"""What a volunteer sees: a progress bar per round (loss, tokens/s) and one line per round.

Everything goes to stderr through one rich console, so log lines and the live bar never
interleave. The bar is off when stderr is not a terminal or with ``--quiet``; ``--quiet``
also drops the per-round lines, keeping warnings, errors and the final summary.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from client.gpu import mfu as model_flops_utilisation

REFRESH_S = 0.25  # redraw the bar at most this often


class Reporter:
    def __init__(self, *, quiet: bool = False, bar: bool | None = None) -> None:
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self.quiet = quiet
        self.bar = (not quiet and sys.stderr.isatty()) if bar is None else bar

    def _print(self, message: str) -> None:
        self.console.print(Text(message))

    def info(self, message: str) -> None:
        """A line for the normal run of things (per round, waiting); dropped by --quiet."""
        if not self.quiet:
            self._print(message)

    def warn(self, message: str) -> None:
        self._print(f"warning: {message}")

    def always(self, message: str) -> None:
        self._print(message)

    def round_bar(self, round_index: int, steps: int) -> RoundBar:
        return RoundBar(self, round_index, steps)


class RoundBar:
    """A bar for one round's inner steps; ``step`` may be called from the training thread."""

    def __init__(self, reporter: Reporter, round_index: int, steps: int) -> None:
        self.steps = steps
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        self.last_step: int | None = None  # 1-based, for heartbeats
        self.last_loss: float | None = None
        self._drawn = 0.0  # when the bar was last drawn
        self.flops_per_token = 0.0  # set by count_flops: the bar then shows MFU
        self.peak_flops: float | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if reporter.bar:
            self._progress = Progress(
                TextColumn(f"round {round_index}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[rate]} tok/s{task.fields[mfu]}"),
                TimeElapsedColumn(),
                console=reporter.console,
                transient=True,
                auto_refresh=False,  # no render thread competing with torch for the cores
            )
            self._task = self._progress.add_task("train", total=steps, loss="-", rate="-", mfu="")

    def __enter__(self) -> RoundBar:
        self.started = time.perf_counter()  # tokens/s counts training time only
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def count_flops(self, flops_per_token: float, peak_flops: float | None) -> None:
        """Show MFU beside tokens/s: the model's FLOPs per token over the device's peak."""
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops

    def step(self, done: int, loss: float, tokens: int) -> None:
        """``done`` steps of ``steps`` are finished, ``tokens`` trained on so far."""
        with self._lock:
            self.last_step, self.last_loss = done, loss
        now = time.perf_counter()
        if self._progress is None or self._task is None:
            return
        if now - self._drawn < REFRESH_S and done < self.steps:
            return
        self._drawn = now
        rate = tokens / max(now - self.started, 1e-9)
        mfu = model_flops_utilisation(rate, self.flops_per_token, self.peak_flops)
        self._progress.update(
            self._task,
            completed=done,
            loss=f"{loss:.4f}",
            rate=f"{rate:,.0f}",
            mfu="" if mfu is None else f"  MFU {mfu:.1%}",
            refresh=True,
        )

    def latest(self) -> tuple[int | None, float | None]:
        with self._lock:
            return self.last_step, self.last_loss
