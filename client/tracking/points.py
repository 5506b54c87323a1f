"""A closed round as the trackers write it (``RoundPoint``), and what a sink has written
(``Logged``, its state file)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.atomic import atomic_write_text

STATE_FILE = "diloco-track.json"


class TrackError(Exception):
    """A tracker cannot be used as asked (an extra is missing, a state file is not ours)."""


# ---------------------------------------------------------------------------- the points


@dataclass(frozen=True)
class RoundPoint:
    """A closed round as the trackers get it; ``step`` is the tokens trained through it."""

    index: int
    step: int
    tokens: int
    accepted: int
    late: int
    train_loss: float | None
    eval_loss: float | None  # None: pending (or never known: not finite)
    update_norm: float | None
    bytes_up: int | None  # None: not read (no sink still needed the round)
    close_code: str | None
    close_reason: str | None

    def scalars(self) -> dict[str, float]:
        """Everything but the eval loss, by tag (TensorBoard) or key (W&B)."""
        out: dict[str, float] = {
            "round/index": float(self.index),
            "round/tokens": float(self.tokens),
            "round/accepted": float(self.accepted),
            "round/late": float(self.late),
        }
        for key, value in (
            ("loss/train", self.train_loss),
            ("round/update_norm", self.update_norm),
            ("round/bytes_up", self.bytes_up),
        ):
            if value is not None:
                out[key] = float(value)
        return out

    @property
    def reason(self) -> str:
        return f"{self.close_code or 'closed'}: {self.close_reason or ''}".rstrip(": ")


def _float(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def closed_prefix(rounds: Iterable[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], int]]:
    """The run's closed rounds, in order, each with the tokens trained through it. Rounds
    close one after the other (a round opens when the one before closes), so the closed
    ones are 1..k; the list stops at the first round that is not closed."""
    out, step = [], 0
    for r in sorted(rounds, key=lambda r: int(r["index"])):
        if r.get("state") != "closed":
            break
        step += int(r.get("tokens") or 0)
        out.append((r, step))
    return out


def point_of(r: Mapping[str, Any], step: int, bytes_up: int | None) -> RoundPoint:
    return RoundPoint(
        index=int(r["index"]),
        step=step,
        tokens=int(r.get("tokens") or 0),
        accepted=int(r.get("accepted") or 0),
        late=int(r.get("late") or 0),
        train_loss=_float(r.get("train_loss")),
        eval_loss=_float(r.get("eval_loss")),
        update_norm=_float(r.get("update_norm")),
        bytes_up=bytes_up,
        close_code=r.get("close_code"),
        close_reason=r.get("close_reason"),
    )


# ----------------------------------------------------------------------- what was written


@dataclass
class Logged:
    """What one sink has written for one run: rounds 1..``rounds_through`` and the eval
    losses of ``evals``. Kept as JSON at ``path``, replaced atomically (``save``)."""

    path: Path
    run_id: str
    rounds_through: int = 0
    evals: set[int] = field(default_factory=set)

    @classmethod
    def load(cls, path: Path, run_id: str) -> Logged:
        if not path.exists():
            return cls(path, run_id)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data["run_id"] != run_id:
                raise TrackError(
                    f"{path} records run {data['run_id']}, not {run_id}: give each run its own "
                    "directory (or remove the file to write everything again)"
                )
            return cls(path, run_id, int(data["rounds_through"]), {int(i) for i in data["evals"]})
        except (ValueError, KeyError, TypeError) as err:
            raise TrackError(f"{path} is not a tracker state file ({err}); remove it") from err

    def save(self) -> None:
        """Replace the file (temp name, fsync, rename: a crash leaves the old one or this)."""
        data = {"run_id": self.run_id, "rounds_through": self.rounds_through}
        data["evals"] = sorted(self.evals)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write_text(self.path) as f:
            json.dump(data, f)
