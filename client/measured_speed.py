"""The training speed ``diloco doctor`` measured for a run, kept for ``diloco join``.

The server sizes each lease's H to the speed a volunteer reports with its join
(``diloco.protocol.sizing``); the client reports its last round's tokens/s, so its first
join would report nothing and get the run's nominal H. A doctor run against the run
leaves its dry run's figure in the run's cache folder (``speed.json``), and the first join
reports that instead, when it was measured on the same kind of device in the same
precision (the micro-batch and batch it ran at are recorded beside it). A file that does
not read is said and ignored (never trusted blind): the worker then joins as if no doctor
had run.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from client import credentials
from diloco.atomic import atomic_write_text
from diloco.protocol.messages import MAX_TOKENS_PER_S

if TYPE_CHECKING:  # the CLI reads speeds without torch (client.progress imports it)
    from client.progress import Reporter

SPEED_FILE = "speed.json"


class SpeedRecordError(ValueError):
    """speed.json exists but does not hold a usable measurement."""


@dataclass(frozen=True)
class MeasuredSpeed:
    tokens_per_s: float
    device: str  # "cuda", "mps", "cpu"
    precision: str  # "bf16", "fp16", "fp32"
    micro_batch: int
    batch_size: int

    def applies_to(self, device: str, precision: str) -> bool:
        """Measured the way a worker on ``device`` in ``precision`` trains."""
        return (self.device, self.precision) == (device, precision)


def speed_path(run_id: str, root: Path | None = None) -> Path:
    return credentials.run_cache_dir(run_id, root) / SPEED_FILE


def save_speed(run_id: str, speed: MeasuredSpeed, root: Path | None = None) -> Path:
    path = speed_path(run_id, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write_text(path) as f:
        json.dump(asdict(speed), f)
    return path


def load_speed(run_id: str, root: Path | None = None) -> MeasuredSpeed | None:
    """The saved measurement; None if no doctor ran for this run; SpeedRecordError if the
    file is there but unusable (the caller says so)."""
    path = speed_path(run_id, root)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpeedRecordError(f"{path} does not read ({err})") from None
    try:
        speed = MeasuredSpeed(
            tokens_per_s=float(raw["tokens_per_s"]),
            device=str(raw["device"]),
            precision=str(raw["precision"]),
            micro_batch=int(raw["micro_batch"]),
            batch_size=int(raw["batch_size"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise SpeedRecordError(f"{path} lacks a field or has a bad one ({err!r})") from None
    if not (math.isfinite(speed.tokens_per_s) and 0 < speed.tokens_per_s <= MAX_TOKENS_PER_S):
        raise SpeedRecordError(f"{path}: tokens_per_s {speed.tokens_per_s} is out of range")
    return speed


def first_speed(
    run_id: str, root: Path | None, device: str, precision: str, say: Reporter
) -> float | None:
    """The tokens/s ``diloco doctor`` measured for this run on this ``device`` type and
    ``precision``, for a volunteer's first join to report; None (and why, if it is worth
    saying) when there is none that fits."""
    try:
        saved = load_speed(run_id, root)
    except SpeedRecordError as err:
        say.warn(f"not reporting diloco doctor's speed: {err}")
        return None
    if saved is None or not saved.applies_to(device, precision):
        return None
    say.info(
        f"first join reports diloco doctor's {saved.tokens_per_s:,.0f} tokens/s "
        f"({device} {precision})"
    )
    return saved.tokens_per_s
