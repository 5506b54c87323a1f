"""The durable global state of a run: one safetensors file per checkpoint version.

The server writes one after each outer step and serves it to volunteers (ETag = sha256).
safetensors + JSON only: a checkpoint travels over the network, so nothing is unpickled.

Layout of the file:
- the model parameters under their own names;
- the outer SGD momentum buffers (fp32) under ``outer.momentum.<param name>``;
- string metadata: ``format``, ``format_version``, ``version``, ``param_names`` (JSON list;
  its order is the optimizer's parameter order), ``outer_hparams`` (JSON of the SGD
  param_group without its ``params``, only with outer state), ``outer_momentum``
  ("true" when momentum buffers are stored: a fresh SGD has none yet), plus caller metadata.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from diloco.atomic import atomic_write
from diloco.wire.tensorfile import Entry, TensorFileError, TensorFileReader, TensorFileWriter

FORMAT = "diloco-checkpoint"
FORMAT_VERSION = "1"
MOMENTUM_PREFIX = "outer.momentum."
RESERVED_KEYS = frozenset(
    {"format", "format_version", "version", "param_names", "outer_hparams", "outer_momentum"}
)


class CheckpointError(ValueError):
    """A file that is missing, corrupt, truncated or not one of our checkpoints."""


@dataclass(frozen=True)
class Checkpoint:
    version: int
    params: dict[str, torch.Tensor]
    # in the shape OuterOptimizer.load_state_dict accepts; None for a params-only checkpoint
    outer_state: dict[str, Any] | None
    metadata: dict[str, str]  # the caller's metadata, reserved keys removed
    sha256: str  # of the exact bytes the tensors were loaded from


def _outer_tensors(
    names: list[str], outer_state: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split OuterOptimizer.state_dict() into momentum tensors and JSON-able hparams."""
    if list(outer_state["names"]) != names:
        raise ValueError("outer_state was saved for other parameter names than params")
    sgd = outer_state["sgd"]
    groups = sgd["param_groups"]
    if len(groups) != 1 or list(groups[0]["params"]) != list(range(len(names))):
        raise ValueError("outer_state must have one param group holding every parameter in order")
    hparams = {k: v for k, v in groups[0].items() if k != "params"}
    buffers = {i: s["momentum_buffer"] for i, s in sgd["state"].items() if "momentum_buffer" in s}
    if buffers and buffers.keys() != set(range(len(names))):
        raise ValueError("outer_state has momentum for some parameters but not all")
    tensors = {MOMENTUM_PREFIX + names[i]: b.detach().float().cpu() for i, b in buffers.items()}
    return tensors, hparams


def save_checkpoint(
    path: Path,
    *,
    params: Mapping[str, torch.Tensor],
    version: int,
    outer_state: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> str:
    """Write the checkpoint atomically and return the sha256 of its bytes.

    Commit or discard (``diloco.atomic``): the bytes go to a temp name in the same
    directory, are fsynced and renamed over ``path``, then the directory is fsynced; a crash
    at any point leaves either the old file or the new one, never a mix (invariant 2).
    """
    meta = dict(metadata or {})
    if clash := RESERVED_KEYS & meta.keys():
        raise ValueError(f"metadata keys {sorted(clash)} are reserved by the checkpoint format")
    if not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("metadata values must be strings (safetensors stores str -> str)")
    names = list(params)
    if bad := [n for n in names if n.startswith(MOMENTUM_PREFIX)]:
        raise ValueError(f"parameter names {bad} use the reserved prefix {MOMENTUM_PREFIX!r}")
    tensors = {n: p.detach().cpu().contiguous() for n, p in params.items()}
    meta |= {"format": FORMAT, "format_version": FORMAT_VERSION}
    meta |= {"version": str(int(version)), "param_names": json.dumps(names)}
    if outer_state is not None:
        momentum, hparams = _outer_tensors(names, outer_state)
        tensors |= momentum
        try:
            meta["outer_hparams"] = json.dumps(hparams)
        except TypeError as e:
            raise ValueError(f"outer hyper-parameters are not JSON-serializable: {e}") from e
        meta["outer_momentum"] = json.dumps(bool(momentum))
    data = safetensors_save(tensors, metadata=meta)
    digest = hashlib.sha256(data).hexdigest()

    with atomic_write(Path(path)) as f:
        f.write(data)
    return digest


def _header_metadata(data: bytes, path: Path) -> dict[str, str]:
    """Read safetensors' ``__metadata__`` from the raw bytes (8-byte LE length + JSON)."""
    if len(data) < 8:
        raise CheckpointError(f"{path} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CheckpointError(f"{path} is truncated or corrupt (header runs past the end)")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} has a corrupt safetensors header: {e}") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def _check_format(meta: Mapping[str, str], path: Path) -> tuple[int, list[str]]:
    """Refuse foreign or future files before trusting any of their contents."""
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a DiLoCo checkpoint (no format={FORMAT!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format_version {meta.get('format_version')!r}; "
            f"this code reads version {FORMAT_VERSION}"
        )
    try:
        version = int(meta["version"])
        names = json.loads(meta["param_names"])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path} has missing or malformed version/param_names: {e}") from e
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{path} has param_names that are not a list of strings")
    return version, names


def load_checkpoint(path: Path) -> Checkpoint:
    """Load and validate a checkpoint, ready to rebuild an OuterOptimizer.

    The file is read once into memory so that the sha256 describes exactly the bytes the
    tensors came from, even if a writer replaces the file meanwhile.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    meta = _header_metadata(data, path)
    version, names = _check_format(meta, path)
    try:
        tensors = safetensors_load(data)
    except SafetensorError as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from e
    stored = {k for k in tensors if not k.startswith(MOMENTUM_PREFIX)}
    if stored != set(names):
        raise CheckpointError(
            f"{path} tensors differ from param_names: {sorted(stored ^ set(names))}"
        )
    outer_state = None
    if "outer_hparams" in meta:
        try:
            hparams = json.loads(meta["outer_hparams"])
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} has malformed outer_hparams: {e}") from e
        if not isinstance(hparams, dict):
            raise CheckpointError(f"{path} has outer_hparams that are not a JSON object")
        state: dict[int, dict[str, torch.Tensor]] = {}
        if meta.get("outer_momentum") == "true":
            if missing := [n for n in names if MOMENTUM_PREFIX + n not in tensors]:
                raise CheckpointError(f"{path} lacks outer momentum for parameters {missing}")
            state = {
                i: {"momentum_buffer": tensors[MOMENTUM_PREFIX + n]} for i, n in enumerate(names)
            }
        group = {**hparams, "params": list(range(len(names)))}
        outer_state = {"names": names, "sgd": {"state": state, "param_groups": [group]}}
    return Checkpoint(
        version=version,
        params={n: tensors[n] for n in names},
        outer_state=outer_state,
        metadata={k: v for k, v in meta.items() if k not in RESERVED_KEYS},
        sha256=hashlib.sha256(data).hexdigest(),
    )


def checkpoint_params_only(path: Path) -> dict[str, torch.Tensor]:
    """The model parameters alone, for clients: momentum buffers are never read (mmap)."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            _, names = _check_format(f.metadata() or {}, path)
            return {n: f.get_tensor(n) for n in names}
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e


# ---------------------------------------------------------------- streamed files (the server)

RESIDUAL_PREFIX = "outer.residual."


def params_entries(shapes: Mapping[str, tuple[int, ...]]) -> list[Entry]:
    """The parameters file's tensors, in the model's order (fp32)."""
    return [Entry(n, torch.float32, tuple(s)) for n, s in shapes.items()]


def params_metadata(
    *, version: int, names: list[str], metadata: Mapping[str, str] | None = None
) -> dict[str, str]:
    meta = dict(metadata or {})
    if clash := RESERVED_KEYS & meta.keys():
        raise ValueError(f"metadata keys {sorted(clash)} are reserved by the checkpoint format")
    return meta | {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "version": str(int(version)),
        "param_names": json.dumps(names),
    }


def write_params(
    path: Path,
    params: Mapping[str, torch.Tensor],
    *,
    version: int,
    metadata: Mapping[str, str] | None = None,
) -> str:
    """The parameters file of a version, streamed (no serialised copy in memory); its
    sha256. The server writes the same layout chunk by chunk (``diloco.outer.chunked``), and a
    volunteer that rebuilt θ from deltas writes it with this to check the sha256."""
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    meta = params_metadata(version=version, names=list(shapes), metadata=metadata)
    with TensorFileWriter(Path(path), params_entries(shapes), meta) as out:
        for name, p in params.items():
            out.write(name, 0, p.detach().float().cpu().reshape(-1))
        return out.commit()


STATE_FORMAT = "diloco-outer-state"


def state_entries(shapes: Mapping[str, tuple[int, ...]]) -> list[Entry]:
    """The outer state file's tensors: Nesterov momentum, then the delta residual."""
    return [Entry(MOMENTUM_PREFIX + n, torch.float32, tuple(s)) for n, s in shapes.items()] + [
        Entry(RESIDUAL_PREFIX + n, torch.float32, tuple(s)) for n, s in shapes.items()
    ]


def state_metadata(
    *, version: int, names: list[str], hparams: Mapping[str, Any], metadata: Mapping[str, str]
) -> dict[str, str]:
    return dict(metadata) | {
        "format": STATE_FORMAT,
        "format_version": FORMAT_VERSION,
        "version": str(int(version)),
        "param_names": json.dumps(names),
        "outer_hparams": json.dumps(dict(hparams)),
        "outer_momentum": "true",
    }


def write_initial_state(
    path: Path, *, names: list[str], hparams: Mapping[str, Any], metadata: Mapping[str, str]
) -> None:
    """Version 0's outer state file: no momentum yet and no residual (the first close reads
    both as zeros)."""
    meta = state_metadata(version=0, names=names, hparams=hparams, metadata=metadata)
    meta["outer_momentum"] = "false"
    with TensorFileWriter(Path(path), [], meta, digest=False) as out:
        out.commit()


@dataclass(frozen=True)
class OuterStateFile:
    """Where a version's momentum and residual are, read range by range. A version without
    momentum yet (0) or without a residual (written before deltas existed) reads zeros;
    ``has_momentum`` tells the first outer step apart (its momentum starts at the update)."""

    reader: TensorFileReader
    version: int
    names: list[str]
    has_momentum: bool
    has_residual: bool


def open_outer_state(path: Path) -> OuterStateFile:
    """Open a version's state file: this format, or the older one that also held the
    parameters (``save_checkpoint`` with ``outer_state``)."""
    try:
        reader = TensorFileReader(Path(path))
    except TensorFileError as err:
        raise CheckpointError(str(err)) from err
    meta = reader.metadata
    try:
        if meta.get("format") == STATE_FORMAT:
            if meta.get("format_version") != FORMAT_VERSION:
                raise CheckpointError(
                    f"{path} has state format_version {meta.get('format_version')}"
                )
            version, names = int(meta["version"]), json.loads(meta["param_names"])
        else:
            version, names = _check_format(meta, Path(path))
        has_momentum = meta.get("outer_momentum") == "true"
        has_residual = all(RESIDUAL_PREFIX + n in reader.entries for n in names)
        if has_momentum and not all(MOMENTUM_PREFIX + n in reader.entries for n in names):
            raise CheckpointError(f"{path} lacks outer momentum for some parameters")
    except (CheckpointError, KeyError, ValueError) as err:
        reader.close()
        raise CheckpointError(f"{path}: {err}") from err
    return OuterStateFile(reader, version, list(names), has_momentum, has_residual)
