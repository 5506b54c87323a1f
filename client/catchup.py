"""Catching up by deltas: from a cached older checkpoint to the leased one.

A volunteer that missed rounds holds θ_h of the run and is leased θ_v. The server's plan
(``GET /runs/{id}/checkpoints/{v}/catch-up?from=h``) names the int8 deltas h+1..v when each
exists and together they are smaller than the full file. Each is downloaded like any file
(resumable, sha256-checked), they are applied in order to θ_h (θ ← θ + decode(q), fp32:
the very additions the server made), and the result is written in the published file's
layout (``diloco.checkpoint.write_params``) under a temp name. Only when its sha256 is the
lease's is it renamed into the cache: a volunteer never trains on an unverified file. Any
failure (no plan, a delta that does not fit, one bit of difference) is a warning, and the
caller downloads the full checkpoint instead.

Only the newest cached version matters (it gives the shortest chain), so the cache keeps
what ``credentials.prune_checkpoints`` keeps: the newest version and the one before.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from client import credentials
from client.api import ServerAPI
from client.download import part_path
from client.progress import Reporter
from diloco import atomic
from diloco.checkpoint import checkpoint_params_only, write_params
from diloco.protocol.messages import CheckpointRef
from diloco.wire.delta import apply_delta, read_delta


@dataclass(frozen=True)
class CaughtUp:
    base_version: int
    deltas: int
    delta_nbytes: int  # what the deltas weighed (transferred, or resumed from a part)
    full_nbytes: int  # what the full checkpoint would have


def held_checkpoint(run_id: str, below: int, root: Path | None) -> tuple[int, Path] | None:
    """The newest cached checkpoint of the run older than ``below``: (version, path)."""
    found: list[tuple[int, Path]] = []
    for path in (credentials.run_cache_dir(run_id, root) / "checkpoints").glob("v*-*.safetensors"):
        stem = path.name.removeprefix("v").split("-", 1)[0]
        if stem.isascii() and stem.isdigit() and int(stem) < below:
            found.append((int(stem), path))
    return max(found, default=None)


def rebuild(held: Path, deltas: list[Path], *, version: int, run_id: str, out: Path) -> str:
    """θ_h plus each delta in order, written as the published parameters file of
    ``version``; its sha256. Raises on a delta that does not fit the parameters."""
    params = checkpoint_params_only(held)
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    for path in deltas:
        apply_delta(params, read_delta(path, shapes))
    return write_params(out, params, version=version, metadata={"run_id": run_id})


async def by_deltas(
    api: ServerAPI,
    say: Reporter,
    *,
    run_id: str,
    checkpoint: CheckpointRef,
    dest: Path,
    root: Path | None,
) -> CaughtUp | None:
    """Put ``checkpoint`` at ``dest`` from the newest cached older version and its deltas;
    None when there is nothing to catch up from, the server advises the full file, or
    anything fails (warned): then the caller downloads the full checkpoint."""
    held = held_checkpoint(run_id, checkpoint.version, root)
    if held is None:
        return None
    have, held_path = held
    what = f"checkpoint v{checkpoint.version}"
    work = credentials.run_cache_dir(run_id, root) / "deltas"
    fetched: list[Path] = []
    rebuilt = atomic.temp_path(dest)
    try:
        plan = await api.catch_up_plan(run_id, checkpoint.version, have)
        if plan.kind != "deltas" or plan.full.sha256 != checkpoint.sha256:
            say.info(f"{what}: no delta chain from v{have} smaller than the file; downloading it")
            return None
        chain = [d.version for d in plan.deltas]
        if chain != list(range(have + 1, checkpoint.version + 1)):
            raise ValueError(f"the plan's deltas {chain} are not the chain from v{have}")
        for d in plan.deltas:
            path = work / f"v{d.version}-{d.sha256}.delta.safetensors"
            fetched.append(path)
            await api.download(d.url, path, d.sha256)
        sha = await asyncio.to_thread(
            rebuild, held_path, fetched, version=checkpoint.version, run_id=run_id, out=rebuilt
        )
        if sha != checkpoint.sha256:
            raise ValueError(f"the rebuilt file has sha256 {sha}, not {checkpoint.sha256}")
        atomic.commit(rebuilt, dest)
    except Exception as err:  # an optimisation only: any failure means the full download
        say.warn(f"{what}: catching up from v{have} by deltas failed ({err}); downloading it whole")
        return None
    finally:
        rebuilt.unlink(missing_ok=True)
        for path in fetched:
            path.unlink(missing_ok=True)
            part_path(path).unlink(missing_ok=True)
    done = CaughtUp(have, len(plan.deltas), plan.delta_nbytes, checkpoint.nbytes)
    say.info(
        f"{what}: caught up from v{have} by {done.deltas} deltas "
        f"({done.delta_nbytes:,} B instead of {done.full_nbytes:,} B; sha256 ok)"
    )
    return done
