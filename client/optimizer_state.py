"""The inner AdamW state on disk, one file per run, so a restarted volunteer resumes with the
moments it had (DiLoCo: a contributor that stays keeps its AdamW state across rounds).

Format: safetensors (never pickle). Tensors are the optimizer's per-parameter state under
``state.<index>.<key>`` (``step``, ``exp_avg``, ``exp_avg_sq``), and the upload codec's
error-feedback residual under ``error.<parameter name>`` when the run's codec keeps one
(int4, int2, sparse: a volunteer that returns goes on from it; one without it, or a new
volunteer, starts from zero); the metadata holds the format version, the run, the
run-config key the state belongs to, the parameter names and shapes in optimizer order,
the param groups (JSON), ``steps``: inner steps taken with this state, and
``first_moment``: ``zero`` when ``exp_avg`` was left out (a run whose leases zero it
anyway), restored as zeros. Written atomically (temp file, fsync, rename): a crash leaves
the old file or the new one. A file for another config or model is refused with a reason,
never half-loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from diloco.atomic import atomic_path

FORMAT = "diloco-adamw/1"
STATE_FILE = "adamw.safetensors"
# the state the lease last uploaded began from, kept until the next upload: an audit asks
# for it (its SHA-256 is the upload's replay record's ``start``; docs/verification.md)
START_FILE = "adamw.start.safetensors"
# the one before it, from the upload before: a close may audit an upload after the next
# one began (the round's least aligned: docs/verification.md), and it asks for that start
PREVIOUS_START_FILE = "adamw.start.previous.safetensors"


class OptimizerStateError(ValueError):
    """A saved optimizer state that cannot be used here (why is in the message)."""


@dataclass(frozen=True)
class SavedState:
    steps: int  # inner steps taken with this state, over every round
    round: int  # the round whose training produced it
    error: dict[str, torch.Tensor] | None = None  # the upload codec's residual, if any


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def save_state(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    run_id: str,
    config_key: str,
    steps: int,
    round: int,
    error: dict[str, torch.Tensor] | None = None,
    first_moment: bool = True,
) -> Path:
    """Write ``optimizer``'s state for ``model`` (and the codec's residual ``error``) to
    ``path`` (atomically). ``first_moment`` False leaves AdamW's ``exp_avg`` out (a run
    with ``[inner] reset_momentum`` zeroes it when a lease starts: kept, it would only
    double the file, and what an audited volunteer sends); ``load_state`` restores it
    as zeros."""
    sd = optimizer.state_dict()
    tensors = {
        f"state.{index}.{key}": value.detach().to("cpu", copy=True).contiguous()
        for index, per_param in sd["state"].items()
        for key, value in per_param.items()
        if isinstance(value, torch.Tensor) and (first_moment or key != "exp_avg")
    }
    for name, residual in (error or {}).items():
        tensors[f"error.{name}"] = residual.detach().to("cpu", torch.float32).contiguous()
    names = _param_names(model, optimizer)
    params = dict(model.named_parameters())
    metadata = {
        "format": FORMAT,
        "run_id": run_id,
        "config_key": config_key,
        "steps": str(steps),
        "round": str(round),
        "params": json.dumps([[n, list(params[n].shape)] for n in names]),
        "param_groups": json.dumps(sd["param_groups"]),
        "first_moment": "kept" if first_moment else "zero",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return path


def keep_as_start(state: Path) -> Path | None:
    """Keep the state file ``state`` as it is now (a hard link, or a copy where links are
    not allowed) under ``START_FILE`` beside it, before a new state replaces it, and the
    start kept before under ``PREVIOUS_START_FILE``; None if there is none."""
    start = state.with_name(START_FILE)
    if not state.exists():
        return None
    if start.exists():  # the previous upload's start, still asked for by a close's audit
        os.replace(start, state.with_name(PREVIOUS_START_FILE))
    with atomic_path(start) as tmp:
        try:
            os.link(state, tmp)
        except OSError:
            shutil.copyfile(state, tmp)
    return start


def _read_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    return dict(meta or {})


def load_state(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    run_id: str,
    config_key: str,
) -> SavedState:
    """Load the state saved at ``path`` into ``optimizer``; :class:`OptimizerStateError` if
    it belongs to another run, config or model (the optimizer is then left untouched)."""
    try:
        meta = _read_metadata(path)
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as err:
        raise OptimizerStateError(f"{path} does not read as a saved AdamW state: {err}") from err
    if meta.get("format") != FORMAT:
        raise OptimizerStateError(f"{path} has format {meta.get('format')!r}, not {FORMAT!r}")
    if meta.get("run_id") != run_id or meta.get("config_key") != config_key:
        raise OptimizerStateError(f"{path} was saved for another run or run config")
    params = dict(model.named_parameters())
    try:
        saved = [(str(n), tuple(s)) for n, s in json.loads(meta["params"])]
        groups = json.loads(meta["param_groups"])
        steps, round_ = int(meta["steps"]), int(meta["round"])
    except (KeyError, ValueError, TypeError) as err:
        raise OptimizerStateError(f"{path} has unreadable metadata ({err})") from err
    current = [(n, tuple(params[n].shape)) for n in _param_names(model, optimizer)]
    if saved != current:
        raise OptimizerStateError(f"{path} was saved for a model with other parameters")
    state: dict[int, dict[str, torch.Tensor]] = {}
    error = {k.removeprefix("error."): v for k, v in tensors.items() if k.startswith("error.")}
    if any(n not in params or tuple(v.shape) != tuple(params[n].shape) for n, v in error.items()):
        raise OptimizerStateError(f"{path}: its error-feedback residual does not fit the model")
    for key, value in tensors.items():
        if key.startswith("error."):
            continue
        _, position, name = key.split(".", 2)
        state.setdefault(int(position), {})[name] = value
    if meta.get("first_moment") == "zero":  # left out as zeros (save_state)
        for per_param in state.values():
            if "exp_avg_sq" in per_param and "exp_avg" not in per_param:
                per_param["exp_avg"] = torch.zeros_like(per_param["exp_avg_sq"])
    for index, per_param in state.items():
        shape = current[index][1] if 0 <= index < len(current) else None
        if any(k != "step" and tuple(v.shape) != shape for k, v in per_param.items()):
            raise OptimizerStateError(f"{path}: the state of parameter {index} has the wrong shape")
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as err:
        raise OptimizerStateError(f"{path} does not fit this optimizer: {err}") from err
    return SavedState(steps=steps, round=round_, error=error or None)
