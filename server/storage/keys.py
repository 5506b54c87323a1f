"""Where each object lives in the store: the one definition of the key layout.

::

    runs/<run>/                                  everything of a run (deleted with it)
        data/val.bin                             a text run's validation tokens
        data/shard-<i>.bin                       its training shard i
        checkpoints/<v>.safetensors              version v's parameters
        checkpoints/<v>.state.safetensors        its outer momentum and residual
        checkpoints/<v>.delta.safetensors        the int8 delta from version v − 1
        rounds/<r>/<contributor>-<8 hex>.bin     an accepted contribution trained for round r
        incoming/<r>/<contributor>.bin           a direct upload, not yet committed
        audits/<audit>.safetensors               the AdamW state an audited lease began from
    datasets/<id>/<file>                         a prepared dataset's files, shared by runs

Every module that names an object builds its key here (``from server import keys``); the
janitor, retention and ``GET /runs/{id}/storage`` read keys back with ``run_of`` and
``kind_of``. ``server.storage.base`` stores whatever key it is given.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from diloco.data.manifest import VAL, shard_file

RUNS = "runs/"
DATASETS = "datasets/"


def run(run_id: str) -> str:
    """The prefix of everything a run holds."""
    return f"{RUNS}{run_id}/"


def run_of(key: str) -> str | None:
    """The run a key belongs to (None: not under ``runs/<id>/``)."""
    parts = key.split("/")
    return parts[1] if len(parts) >= 3 and f"{parts[0]}/" == RUNS else None


# ---------------------------------------------------------------- a run's data


def data(run_id: str) -> str:
    """The prefix of a text run's data, split at its creation."""
    return f"{run(run_id)}data/"


def val(run_id: str) -> str:
    return f"{data(run_id)}{VAL}"


def shard(run_id: str, index: int) -> str:
    return f"{data(run_id)}shard-{index}.bin"


# ---------------------------------------------------------------- checkpoints


def checkpoints(run_id: str) -> str:
    """The prefix of a run's versions."""
    return f"{run(run_id)}checkpoints/"


@dataclass(frozen=True)
class VersionKeys:
    params: str
    state: str
    delta: str  # version 0 has none


def version(run_id: str, v: int) -> VersionKeys:
    folder = checkpoints(run_id)
    return VersionKeys(
        f"{folder}{v}.safetensors",
        f"{folder}{v}.state.safetensors",
        f"{folder}{v}.delta.safetensors",
    )


# ---------------------------------------------------------------- contributions


def rounds(run_id: str) -> str:
    """The prefix of a run's accepted contributions."""
    return f"{run(run_id)}rounds/"


def contribution(run_id: str, round_index: int, contributor_id: str) -> str:
    """A fresh key for an accepted contribution (a random suffix: a retry never overwrites
    the blob a committed row names)."""
    return f"{rounds(run_id)}{round_index}/{contributor_id}-{secrets.token_hex(4)}.bin"


def audit_state(run_id: str, audit_id: str) -> str:
    """The AdamW state an audited volunteer revealed (``server.audits``): its lease began
    from it."""
    return f"{run(run_id)}audits/{audit_id}.safetensors"


def is_contribution(key: str) -> bool:
    """``runs/<id>/rounds/<r>/<name>``: a contribution's blob."""
    parts = key.split("/")
    return len(parts) == 5 and run_of(key) is not None and parts[2] == "rounds"


def incoming(run_id: str, round_index: int, contributor_id: str) -> str:
    """Where a direct upload is PUT before its commit (one per contributor and round)."""
    return f"{run(run_id)}incoming/{round_index}/{contributor_id}.bin"


# ---------------------------------------------------------------- datasets


def dataset(dataset_id: str) -> str:
    """The prefix of a prepared dataset's files."""
    return f"{DATASETS}{dataset_id}/"


def dataset_file(dataset_id: str, name: str) -> str:
    return f"{dataset(dataset_id)}{name}"


def training_shard(run_id: str, dataset_id: str | None, index: int) -> str:
    """Where a run's training shard ``index`` is: the dataset's file, or the run's own."""
    if dataset_id is None:
        return shard(run_id, index)
    return dataset_file(dataset_id, shard_file(index))


def validation(run_id: str, dataset_id: str | None) -> str:
    """Where a run's validation tokens are: the dataset's file, or the run's own."""
    return val(run_id) if dataset_id is None else dataset_file(dataset_id, VAL)


# ---------------------------------------------------------------- reading keys back

_VERSION_FILE = re.compile(r"^checkpoints/\d+(\.state|\.delta)?\.safetensors$")


def kind_of(rest: str) -> str:
    """The kind of a run's committed key, given without its ``runs/<id>/`` prefix:
    data, checkpoints, states, deltas, contributions, incoming, audits, or other."""
    if m := _VERSION_FILE.match(rest):
        return {None: "checkpoints", ".state": "states", ".delta": "deltas"}[m.group(1)]
    top = rest.split("/", 1)[0]
    kinds = {"data": "data", "rounds": "contributions", "incoming": "incoming", "audits": "audits"}
    return kinds.get(top, "other")


def is_data(key: str) -> bool:
    """A run's own data (its shards and validation tokens) or a prepared dataset's file:
    written once, read again by every score and eval."""
    run_id = run_of(key)
    return key.startswith(DATASETS) or (run_id is not None and key.startswith(data(run_id)))


def written_at_creation(key: str) -> bool:
    """A run creation writes the run's data and version 0 (no delta), nothing else."""
    run_id = run_of(key)
    if run_id is None:
        return False
    zero = version(run_id, 0)
    return key.startswith(data(run_id)) or key in (zero.params, zero.state)
